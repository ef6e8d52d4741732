"""The packet emulator of the `tun` backend: IP packets in from one TUN device, out of the other.

`PacketScheduler` is the model of one direction, a pure function of arrival times, sizes and a
seeded RNG (tested without any device). Per packet, in this order:

1. cut: while the link is cut every packet is dropped (a black hole, as when the radio is gone);
2. loss: dropped with probability `loss_pct` (a real drop: the kernel TCP retransmits);
3. bottleneck: with `rate_mbit` set, packets are serialized one after another at that rate
   (serialization time = bytes x 8 / rate); a packet that finds more than `queue_kib` of backlog
   waiting for the bottleneck is tail-dropped;
4. delay: after leaving the bottleneck it spends one-way delay `sample_delay_ms` in flight; packets
   keep their order (a packet never arrives before the one sent before it, as on a real bearer and
   as netem does with a rate), except a share `reorder_pct` that is delivered at once, without the
   delay, overtaking the packets in flight (netem's `reorder`).

`PacketEmulator` runs both directions over two TUN file descriptors in one `select` loop, in its own
process (`python -m splitspec.netsim.emulator`, started by `TunBackend`) so that the Python test or
server next to it cannot delay packets through the GIL. Its stdin is a control channel: lines `cut`,
`restore`, `stats` (answered by one JSON line on stdout); EOF on stdin stops it, so it never
outlives the link that started it.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import select
import sys
import time
from dataclasses import asdict, dataclass

from .control import answer
from .profiles import LinkProfile

MAX_PACKET = 65535
MAX_IN_FLIGHT = 100_000  # packets held by the delay line: a memory bound, far above any profile's need


@dataclass
class DirectionStats:
    """Counts of one direction since the start: packets and bytes offered, what happened to them.
    `delivered` counts packets scheduled for delivery; a cut while they are in flight drops them
    after all, and counts them in `cut_dropped` too."""

    packets: int = 0
    bytes: int = 0
    delivered: int = 0
    lost: int = 0
    tail_dropped: int = 0
    cut_dropped: int = 0
    reordered: int = 0


class PacketScheduler:
    """When each packet of one direction leaves the emulated link, or None if it is dropped.

    Times are seconds on any monotonic clock; sizes are bytes of the whole IP packet.
    """

    def __init__(self, profile: LinkProfile, rng: random.Random) -> None:
        self.profile, self.rng = profile, rng
        self.cut = False
        self.bottleneck_free_s = 0.0  # when the bottleneck has finished every admitted packet
        self.last_delivery_s = 0.0  # delivery time of the latest in-order packet
        self.stats = DirectionStats()

    @property
    def rate_bytes_per_s(self) -> float | None:
        return None if self.profile.rate_mbit is None else self.profile.rate_mbit * 1e6 / 8

    def backlog_bytes(self, now_s: float) -> float:
        """Bytes admitted but not yet through the bottleneck at `now_s`."""
        rate = self.rate_bytes_per_s
        return 0.0 if rate is None else max(0.0, self.bottleneck_free_s - now_s) * rate

    def admit(self, now_s: float, nbytes: int) -> float | None:
        """The delivery time (s) of a packet of `nbytes` arriving at `now_s`, or None if dropped."""
        if nbytes <= 0:
            raise ValueError(f"a packet has at least one byte, got {nbytes}")
        p, stats = self.profile, self.stats
        stats.packets += 1
        stats.bytes += nbytes
        if self.cut:
            stats.cut_dropped += 1
            return None
        if p.loss_pct and self.rng.random() * 100 < p.loss_pct:
            stats.lost += 1
            return None
        rate = self.rate_bytes_per_s
        sent_s = now_s
        if rate is not None:
            if self.backlog_bytes(now_s) + nbytes > p.queue_kib * 1024:
                stats.tail_dropped += 1
                return None
            self.bottleneck_free_s = max(now_s, self.bottleneck_free_s) + nbytes / rate
            sent_s = self.bottleneck_free_s
        delay_s = p.sample_delay_ms(self.rng) / 1e3
        if p.reorder_pct and self.rng.random() * 100 < p.reorder_pct:
            stats.reordered += 1
            stats.delivered += 1
            return sent_s
        at = max(sent_s + delay_s, self.last_delivery_s)
        self.last_delivery_s = at
        stats.delivered += 1
        return at


def direction_rngs(seed: int) -> tuple[random.Random, random.Random]:
    """The (client-to-server, server-to-client) RNGs of a link with this seed."""
    return random.Random(f"{seed}:up"), random.Random(f"{seed}:down")


class PacketEmulator:
    """Moves packets between two TUN fds through one PacketScheduler per direction.

    `client_fd` is the TUN device of the client namespace (packets it yields go up, to the server);
    `server_fd` that of the server namespace. Both must be non-blocking, opened with IFF_NO_PI.
    """

    def __init__(self, profile: LinkProfile, client_fd: int, server_fd: int, clock=time.monotonic) -> None:
        up_rng, down_rng = direction_rngs(profile.seed)
        self.up, self.down = PacketScheduler(profile, up_rng), PacketScheduler(profile, down_rng)
        self.client_fd, self.server_fd, self.clock = client_fd, server_fd, clock
        self.in_flight: list[tuple[float, int, int, bytes]] = []  # heap of (deliver_at_s, seq, out_fd, packet)
        self._seq = 0
        self.emulator_drops = 0  # the delay line was full, or the receiving device refused a write

    def set_cut(self, cut: bool) -> None:
        """Cut (black-hole both directions, dropping what is in flight) or restore the link."""
        self.up.cut = self.down.cut = cut
        if cut:
            for *_, out_fd, _packet in self.in_flight:
                (self.up if out_fd == self.server_fd else self.down).stats.cut_dropped += 1
            self.in_flight.clear()

    def stats(self) -> dict:
        return {"up": asdict(self.up.stats), "down": asdict(self.down.stats), "in_flight": len(self.in_flight),
                "cut": self.up.cut, "emulator_drops": self.emulator_drops}

    def receive(self, in_fd: int) -> None:
        """Read every packet waiting on `in_fd` and schedule it."""
        scheduler, out_fd = (self.up, self.server_fd) if in_fd == self.client_fd else (self.down, self.client_fd)
        while True:
            try:
                packet = os.read(in_fd, MAX_PACKET)
            except BlockingIOError:
                return
            if not packet:
                return
            at = scheduler.admit(self.clock(), len(packet))
            if at is None:
                continue
            if len(self.in_flight) >= MAX_IN_FLIGHT:
                self.emulator_drops += 1
                continue
            self._seq += 1
            heapq.heappush(self.in_flight, (at, self._seq, out_fd, packet))

    def deliver_due(self) -> float | None:
        """Write every packet whose time has come; the seconds until the next one (None: none)."""
        while self.in_flight:
            at = self.in_flight[0][0]
            wait = at - self.clock()
            if wait > 0:
                return wait
            _, _, out_fd, packet = heapq.heappop(self.in_flight)
            try:
                os.write(out_fd, packet)
            except OSError:  # the receiving stack's queue is full: a drop there
                self.emulator_drops += 1
        return None

    def run(self, control_fd: int) -> None:
        """Serve until EOF on `control_fd` (one command a line: cut, restore, stats)."""
        fds = [self.client_fd, self.server_fd, control_fd]
        pending = b""
        while True:
            timeout = self.deliver_due()
            readable, _, _ = select.select(fds, [], [], timeout)  # select: microsecond timeouts
            for fd in readable:
                if fd != control_fd:
                    self.receive(fd)
                    continue
                data = os.read(control_fd, 4096)
                if not data:
                    return
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    self._command(line.decode(errors="replace").strip())

    def _command(self, command: str) -> None:
        print(answer(command, self.set_cut, self.stats), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Child process entry: `--profile JSON --client-fd N --server-fd M` (fds passed by the parent)."""
    parser = argparse.ArgumentParser(prog="python -m splitspec.netsim.emulator")
    parser.add_argument("--profile", required=True, help="LinkProfile fields as JSON")
    parser.add_argument("--client-fd", type=int, required=True)
    parser.add_argument("--server-fd", type=int, required=True)
    args = parser.parse_args(argv)
    profile = LinkProfile(**json.loads(args.profile))
    for fd in (args.client_fd, args.server_fd):
        os.set_blocking(fd, False)
    emulator = PacketEmulator(profile, args.client_fd, args.server_fd)
    print(json.dumps({"ready": True}), flush=True)
    try:
        emulator.run(sys.stdin.fileno())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
