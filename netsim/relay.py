"""The `relay` backend: an unprivileged asyncio TCP relay that emulates a link per chunk.

Each chunk read from one side is delivered to the other after the profile's one-way delay (drawn
per chunk), behind a bottleneck of `rate_mbit` (chunks queue and are serialized in order), and
with probability `loss_pct` a chunk is "lost": TCP would retransmit it, so it is delivered late by
a stall of max(200 ms minimum RTO, 2 x RTT) instead of being dropped (the relay carries a byte
stream, so it cannot drop bytes). Order is kept within a direction.

`cut()` black-holes both directions until `restore()`, and so does an offline profile (loss 100%,
`LinkProfile.offline`), as on the packet-level backends: bytes, half-closes (FIN) and closes are
held and cross in order once the link is up; a connection made while the link is down is accepted
by the kernel and left unanswered (the server is not contacted, nor is the client refused) until
then. While the link is down, or the bottleneck is behind, a direction holds at most `MAX_HELD`
bytes: then the relay stops reading from the sender, whose TCP window fills, as on a real link.

Fidelity limits (measured in RELIABILITY.md on these machines): small-message latency matches a
kernel-level emulator; bulk throughput under loss is overstated, since real TCP also shrinks its
congestion window. Sockets get TCP_NODELAY, as gRPC sets it itself.

`RelayThread` runs a RelayLink on a thread of this process; `RelayProcess` in a child process
(this module's `main`), so that nothing else in the caller delays it through the GIL.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import selectors
import socket
import subprocess
import sys
import threading
import time

from .control import answer, ask
from .profiles import LinkProfile

CHUNK = 64 * 1024
MIN_RTO_MS = 200.0
MAX_HELD = 4 << 20  # bytes one direction holds (read, not yet delivered) before it stops reading


class _Direction:
    """Delivery schedule of one direction of one connection."""

    def __init__(self, profile: LinkProfile, rng: random.Random) -> None:
        self.profile, self.rng = profile, rng
        self.bottleneck_free = 0.0  # when the bottleneck finishes the previous chunk (monotonic s)
        self.last_delivery = 0.0

    def deliver_at(self, now: float, nbytes: int) -> float:
        p = self.profile
        start = max(now, self.bottleneck_free)
        self.bottleneck_free = start + p.serialization_ms(nbytes) / 1e3
        delay = p.sample_delay_ms(self.rng)
        if p.loss_pct and self.rng.random() * 100 < p.loss_pct:
            delay += max(MIN_RTO_MS, 2 * p.rtt_ms)
        at = self.bottleneck_free + delay / 1e3
        reordered = p.reorder_pct and self.rng.random() * 100 < p.reorder_pct
        if not reordered:  # a byte stream keeps its order: a chunk never overtakes the one before
            at = max(at, self.last_delivery)
        self.last_delivery = max(self.last_delivery, at)
        return at


class RelayLink:
    """Listens on `listen` and relays every connection to `upstream` through the emulated link."""

    def __init__(self, profile: LinkProfile, upstream: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0)):
        self.profile, self.upstream, self.listen = profile, upstream, listen
        self.rng = random.Random(profile.seed)
        self.server: asyncio.base_events.Server | None = None
        self.connected = asyncio.Event()
        self._cut = False
        self._up = asyncio.Event()  # set while bytes cross: not cut, and the profile is not offline
        self._update_up()
        self._tasks: set[asyncio.Task] = set()
        self._directions: set[_Direction] = set()
        self.bytes_up = self.bytes_down = 0

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1]

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, *self.listen)
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def cut(self) -> None:
        """Black-hole both directions until `restore()` (connections stay open, nothing arrives)."""
        self._cut = True
        self._update_up()

    def set_profile(self, profile: LinkProfile) -> None:
        """Switch the link's delay, rate and loss now, for open connections too (a phone moving
        from 4G to Wi-Fi); bytes already scheduled keep their delivery times. An offline profile
        black-holes the link as `cut()` does, until a profile that is not offline."""
        self.profile = profile
        for direction in self._directions:
            direction.profile = profile
        self._update_up()

    def restore(self) -> None:
        """End a `cut()`: what was held crosses now (unless the profile is offline)."""
        self._cut = False
        self._update_up()

    def _update_up(self) -> None:
        if self._cut or self.profile.offline:
            self._up.clear()
        else:
            self._up.set()

    async def _handle(self, client_reader, client_writer) -> None:
        handler = asyncio.current_task()
        self._tasks.add(handler)  # `stop()` ends a connection still waiting for the link
        try:
            await self._up.wait()  # the SYN crosses only while the link is up
            try:
                server_reader, server_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                await self._up.wait()  # and so does the refusal coming back
                return
            await self._relay(client_reader, client_writer, server_reader, server_writer)
        except asyncio.CancelledError:
            pass  # `stop()`: ending normally, since Python 3.11's streams log a handler task that ends cancelled
        finally:
            self._tasks.discard(handler)
            client_writer.close()

    async def _relay(self, client_reader, client_writer, server_reader, server_writer) -> None:
        for writer in (client_writer, server_writer):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        seed = self.rng.randrange(2**32)
        up = _Direction(self.profile, random.Random(seed))
        down = _Direction(self.profile, random.Random(seed + 1))
        self._directions.update((up, down))
        pumps = [asyncio.create_task(self._pump(client_reader, server_writer, up, "up")),
                 asyncio.create_task(self._pump(server_reader, client_writer, down, "down"))]
        self._tasks.update(pumps)
        try:
            await asyncio.gather(*pumps, return_exceptions=True)
            await self._up.wait()  # the closes cross the link only while it is up
        finally:
            self._tasks.difference_update(pumps)
            self._directions.difference_update((up, down))
            server_writer.close()

    async def _pump(self, reader, writer, direction: _Direction, name: str) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        held = 0  # bytes read from the sender and not yet handed to the receiver
        room = asyncio.Event()  # set when `held` falls to MAX_HELD or the delivery ends

        async def deliver() -> None:
            nonlocal held
            try:
                while True:
                    at, data = await queue.get()
                    await self._up.wait()
                    if data is None:  # the sender closed its side: pass the half-close on
                        if writer.can_write_eof():
                            writer.write_eof()
                        return
                    wait = at - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    await self._up.wait()
                    writer.write(data)
                    held -= len(data)
                    if held <= MAX_HELD:
                        room.set()
                    await writer.drain()
            finally:
                room.set()

        sender = asyncio.create_task(deliver())
        try:
            while True:
                while held > MAX_HELD and not sender.done():  # backpressure: the sender's window fills
                    room.clear()
                    await room.wait()
                if sender.done():  # the receiver is gone: `await sender` says why
                    break
                data = await reader.read(CHUNK)
                if not data:
                    await queue.put((0.0, None))
                    break
                if name == "up":
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                held += len(data)
                await queue.put((direction.deliver_at(time.monotonic(), len(data)), data))
            await sender
        except (ConnectionError, asyncio.CancelledError):
            sender.cancel()
            raise


class RelayThread:
    """A RelayLink on its own event loop thread, for synchronous callers (CLI, tests).

    The loop waits with select(2), so that delivery times are kept to the microsecond."""

    def __init__(self, profile: LinkProfile, upstream: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0)):
        # select(2) takes a timeout in microseconds; epoll's is in whole milliseconds, which would
        # deliver every chunk up to 1 ms late
        self.loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="netsim-relay")
        self.thread.start()
        self.link = self._call(self._make(profile, upstream, listen))
        self.port = self._call(self.link.start())
        self.address = f"{listen[0]}:{self.port}"

    @staticmethod
    async def _make(profile, upstream, listen) -> RelayLink:
        return RelayLink(profile, upstream, listen)

    def _call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def cut(self) -> None:
        self.loop.call_soon_threadsafe(self.link.cut)

    def restore(self) -> None:
        self.loop.call_soon_threadsafe(self.link.restore)

    def set_profile(self, profile: LinkProfile) -> None:
        self.loop.call_soon_threadsafe(self.link.set_profile, profile)

    def stats(self) -> dict:
        """Payload bytes relayed: {"bytes_up": client to server, "bytes_down": server to client}."""
        return {"bytes_up": self.link.bytes_up, "bytes_down": self.link.bytes_down}

    def stop(self) -> None:
        self._call(self.link.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def __enter__(self) -> "RelayThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class RelayProcess:
    """A RelayLink in a child process; the same methods as RelayThread.

    The child runs this module's `main`: it prints {"port": N} once it listens, then
    answers one JSON line per command on stdin (cut, restore, stats, profile) and exits at EOF.

    Raises:
        RuntimeError: the child did not start listening.
    """

    def __init__(self, profile: LinkProfile, upstream: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0)):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from splitspec.netsim.relay import main; sys.exit(main())",
             "--profile", json.dumps(profile.to_dict()),
             "--upstream", f"{upstream[0]}:{upstream[1]}", "--listen", f"{listen[0]}:{listen[1]}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        line = self.proc.stdout.readline()
        if not line.startswith('{"port"'):
            self.stop()
            raise RuntimeError(f"the relay process did not start (exit {self.proc.poll()}): {line!r}")
        self.port = json.loads(line)["port"]
        self.address = f"{listen[0]}:{self.port}"
        self._lock = threading.Lock()

    def _ask(self, command: str) -> dict:
        return ask(self.proc, self._lock, command)

    def cut(self) -> None:
        self._ask("cut")

    def restore(self) -> None:
        self._ask("restore")

    def set_profile(self, profile: LinkProfile) -> None:
        """Raises RuntimeError: the child refused the profile."""
        reply = self._ask("profile " + json.dumps(profile.to_dict()))
        if "error" in reply:
            raise RuntimeError(reply["error"])

    def stats(self) -> dict:
        return self._ask("stats")

    def stop(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> "RelayProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    """Child process of RelayProcess: --profile JSON --upstream HOST:PORT --listen HOST:PORT."""
    parser = argparse.ArgumentParser(prog="splitspec.netsim.relay")
    parser.add_argument("--profile", required=True, help="LinkProfile fields as JSON")
    parser.add_argument("--upstream", required=True, type=_address)
    parser.add_argument("--listen", default="127.0.0.1:0", type=_address)
    args = parser.parse_args(argv)
    relay = RelayThread(LinkProfile(**json.loads(args.profile)), args.upstream, args.listen)
    print(json.dumps({"port": relay.port}), flush=True)
    set_cut = lambda cut: relay.cut() if cut else relay.restore()  # noqa: E731
    set_profile = lambda fields: relay.set_profile(LinkProfile(**fields))  # noqa: E731
    for line in sys.stdin:
        print(answer(line.strip(), set_cut, relay.stats, set_profile), flush=True)
    relay.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
