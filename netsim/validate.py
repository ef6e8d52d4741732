"""Probes that measure what a link really does, to check backends against each other and the profile.

- `echo_round_trips`: ping-pong of a small message over one TCP connection (ms per round trip);
  on an idle link that is one packet each way, so it should follow two one-way delay draws
  (`expected_round_trip`, by Monte Carlo from the profile).
- `bulk_throughput`: one-way transfer of a few seconds' worth of bytes at the profile's rate, over
  one TCP connection; "steady" goodput counts the bytes after the first quarter (slow start left
  out) over the time they took, in Mbit/s of TCP payload (on `tun`/`netem` the rate also carries
  the 40 bytes of IP+TCP header per 1448-byte segment, so payload tops out near 96% of the rate).
- `grpc_round_trips`: unary gRPC calls (the standard health Check, tiny messages) from a client
  process on the client side to a server on the server side: the transport path of a verify step
  without the model work.

- `black_hole`: for an offline profile (loss 100%), which has no round trip to measure: nothing at
  all may come back across the link (no connection answer, no echo, no close).

`validate(profile, backends)` runs them on several backends of the same profile (echo probes at the
same time, so a busy machine affects them alike; bulk transfers one after the other; each
emulator, relay included, in a process of its own), and `format_table` prints the result as
Markdown. Numbers are only comparable within one run.
"""
from __future__ import annotations

import json
import random
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

from .backends import Link, RelayBackend, make_link
from .profiles import LinkProfile

ECHO, DOWNLOAD, UPLOAD = b"E", b"D", b"U"
_HEADER = struct.Struct("!cQ")
_STEADY = struct.Struct("!dQ")
BLOCK = 64 * 1024
MIN_BULK_BYTES = 4 * BLOCK  # the least transfer `bulk_throughput` takes


@dataclass(frozen=True)
class Quantiles:
    """Summary of a latency sample, all in ms."""

    n: int
    p50: float
    p90: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, samples_ms: list[float]) -> "Quantiles":
        if not samples_ms:
            raise ValueError("no samples")
        ordered = sorted(samples_ms)

        def q(p: float) -> float:  # nearest-rank on the sorted sample, linear between ranks
            x = p * (len(ordered) - 1)
            lo = int(x)
            hi = min(lo + 1, len(ordered) - 1)
            return ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo)

        return cls(len(ordered), q(0.50), q(0.90), q(0.99), statistics.fmean(ordered), ordered[-1])


# -- the server side of the probes ---------------------------------------------------------------
class ProbeServer:
    """A TCP server on the link's server side: per connection, one command byte and a length.

    E: echo everything until EOF. D n: send n bytes. U n: read n bytes, then answer with the
    steady part of the transfer as measured here (`_STEADY`: seconds, bytes)."""

    def __init__(self, link: Link) -> None:
        with link.server_side():
            self.sock = socket.socket()
            self.sock.bind((link.server_host, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.address = link.expose(self.port)
        self._thread = threading.Thread(target=self._accept, daemon=True, name="netsim-probe-server")
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        with conn:
            try:
                command, n = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
                if command == ECHO:
                    while data := conn.recv(BLOCK):
                        conn.sendall(data)
                elif command == DOWNLOAD:
                    block = b"\0" * BLOCK
                    for start in range(0, n, BLOCK):
                        conn.sendall(block[: min(BLOCK, n - start)])
                elif command == UPLOAD:
                    conn.sendall(_STEADY.pack(*_receive_steady(conn, n)))
            except (OSError, struct.error):
                return

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "ProbeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        data = sock.recv(min(n - got, BLOCK))
        if not data:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def _receive_steady(sock: socket.socket, n: int) -> tuple[float, int]:
    """Read n bytes; (seconds, bytes) from the moment the first quarter had arrived to the end."""
    got, t_quarter, got_quarter = 0, 0.0, None
    while got < n:
        data = sock.recv(min(n - got, BLOCK))
        if not data:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += len(data)
        if got_quarter is None and got >= n / 4:
            t_quarter, got_quarter = time.perf_counter(), got
    return time.perf_counter() - t_quarter, n - got_quarter


def _connect(link: Link, address: str, command: bytes, n: int = 0, timeout_s: float = 30.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    with link.client_side():
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(_HEADER.pack(command, n))
    return sock


# -- probes --------------------------------------------------------------------------------------
def echo_round_trips(link: Link, server: ProbeServer, samples: int = 500, size: int = 64,
                     warmup: int = 5, stop: threading.Event | None = None) -> list[float]:
    """`samples` round trips (ms) of a `size`-byte message, one at a time, after `warmup` unrecorded.
    Once `stop` is set it returns after the round trip in progress, with the samples so far.

    Raises:
        ConnectionError / socket.timeout: the link lost the connection (e.g. cut for > 30 s).
    """
    if samples < 1 or size < 1:
        raise ValueError(f"samples and size must be >= 1, got {samples}, {size}")
    message = b"x" * size
    out = []
    with _connect(link, server.address, ECHO) as sock:
        for i in range(warmup + samples):
            if stop is not None and stop.is_set():
                break
            t = time.perf_counter()
            sock.sendall(message)
            _recv_exact(sock, size)
            if i >= warmup:
                out.append((time.perf_counter() - t) * 1e3)
    return out


def black_hole(link: Link, server: ProbeServer, wait_s: float = 2.0) -> bool:
    """Whether nothing comes back across the link for `wait_s` seconds: a connection to the echo
    server gets no answer (tun / netem: the SYN is dropped; relay: the connection is left
    unanswered), or, once connected, neither the echo of a byte nor a close arrives."""
    try:
        with _connect(link, server.address, ECHO, timeout_s=wait_s) as sock:
            sock.sendall(b"x")
            sock.recv(1)  # the echo, or b"" for a close: either crossed the link
    except TimeoutError:
        return True
    except OSError:  # refused or reset: an answer crossed the link
        return False
    return False


def bulk_throughput(link: Link, server: ProbeServer, nbytes: int, direction: str = "down") -> float:
    """Steady goodput (Mbit/s of payload) of one `nbytes` transfer; "down" = server to client.

    Raises:
        ValueError: unknown direction or nbytes < 4 blocks.
    """
    if direction not in ("down", "up"):
        raise ValueError(f"direction is 'down' or 'up', got {direction!r}")
    if nbytes < MIN_BULK_BYTES:
        raise ValueError(f"a bulk transfer needs at least {MIN_BULK_BYTES} bytes, got {nbytes}")
    if direction == "down":
        with _connect(link, server.address, DOWNLOAD, nbytes) as sock:
            seconds, steady_bytes = _receive_steady(sock, nbytes)
    else:
        with _connect(link, server.address, UPLOAD, nbytes) as sock:
            block = b"\0" * BLOCK
            for start in range(0, nbytes, BLOCK):
                sock.sendall(block[: min(BLOCK, nbytes - start)])
            seconds, steady_bytes = _STEADY.unpack(_recv_exact(sock, _STEADY.size))
    return steady_bytes * 8 / seconds / 1e6


def default_bulk_bytes(profile: LinkProfile, seconds: float = 2.0) -> int:
    """About `seconds` of transfer at the profile's rate, between 1 and 32 MiB."""
    if profile.rate_mbit is None:
        return 32 << 20
    return int(min(32 << 20, max(1 << 20, profile.rate_mbit * 1e6 / 8 * seconds)))


class GrpcProbeServer:
    """A gRPC server with the standard health service only, listening on the link's server side."""

    def __init__(self, link: Link) -> None:
        from concurrent import futures

        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self.server)
        with link.server_side():  # the listening socket is made here, in the server's namespace
            self.port = self.server.add_insecure_port(f"{link.server_host}:0")
        self.server.start()
        self.address = link.expose(self.port)

    def close(self) -> None:
        self.server.stop(0)


def grpc_round_trips(link: Link, server: GrpcProbeServer, samples: int = 200, warmup: int = 5,
                     timeout_s: float = 120.0) -> list[float]:
    """Round trips (ms) of `samples` unary health Checks from a client process on the client side.

    Raises:
        RuntimeError: the client process failed.
    """
    argv = [sys.executable, "-m", "splitspec.netsim.validate", "grpc-client", server.address, str(samples), str(warmup)]
    proc = link.popen(argv, "client", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout_s)
    if proc.returncode:
        raise RuntimeError(f"gRPC probe client failed ({proc.returncode}): {err.strip()[-500:]}")
    return json.loads(out)


def _grpc_client(address: str, samples: int, warmup: int) -> list[float]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = health_pb2_grpc.HealthStub(channel)
        out = []
        for i in range(warmup + samples):
            t = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            if i >= warmup:
                out.append((time.perf_counter() - t) * 1e3)
    return out


# -- what the profile predicts -------------------------------------------------------------------
def expected_round_trip(profile: LinkProfile, size: int = 64, n: int = 100_000, seed: int = 0) -> Quantiles:
    """Round-trip quantiles (ms) the profile predicts for an idle echo of `size` payload bytes:
    two independent one-way delays plus the serialization of one packet each way (IP+TCP headers
    included). Losses are left out (they move only the top 1/loss-rate of the sample).

    Raises:
        ValueError: the profile is offline: no round trip completes.
    """
    if profile.offline:
        raise ValueError(f"profile {profile.name} is offline (loss 100%): no round trip completes")
    rng = random.Random(seed)
    serialization = 2 * profile.serialization_ms(size + 52)
    return Quantiles.of([profile.sample_delay_ms(rng) + profile.sample_delay_ms(rng) + serialization
                         for _ in range(n)])


# -- several backends, one profile ---------------------------------------------------------------
@dataclass
class ValidationRow:
    """One backend's measurements for one profile (ms, Mbit/s). `rtt` and `expected_rtt` are None
    for an offline profile, which has no round trip (`black_hole` checked that nothing crossed)."""

    backend: str
    profile: str
    seed: int
    rtt: Quantiles | None
    expected_rtt: Quantiles | None
    rate_mbit: float | None
    down_mbit: float | None = None
    up_mbit: float | None = None
    grpc: Quantiles | None = None
    stats: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def validate(profile: LinkProfile, backends: list[str], samples: int = 500, bulk_bytes: int | None = None,
             grpc_samples: int = 0, up: bool = False, progress=None) -> list[ValidationRow]:
    """Run the probes on each backend for `profile`. `bulk_bytes` 0 skips the transfers; None picks
    `default_bulk_bytes`. `grpc_samples` 0 skips the gRPC probe. `progress(str)` hears each phase.
    An offline profile gets the `black_hole` check instead of every probe. An exception here (Ctrl-C
    included) stops the echo probes after their round trip in progress, and removes the links
    without waiting for a probe blocked on one.

    Raises:
        RuntimeError / ValueError: a backend cannot run here (see `choose_backend`).
        RuntimeError: something crossed a backend's link with an offline profile.
    """
    say = progress or (lambda _msg: None)
    bulk_bytes = default_bulk_bytes(profile) if bulk_bytes is None else bulk_bytes
    # every emulator in a process of its own: the probes' threads here cannot delay its packets
    links = [RelayBackend(profile, own_process=True) if name == "relay" else make_link(profile, name)
             for name in backends]
    servers: list[ProbeServer] = []
    try:
        for link in links:
            link.start()
            servers.append(ProbeServer(link))
        if profile.offline:
            return _validate_offline(profile, links, servers, say)
        say(f"{profile.name}: {samples} echo round trips on {', '.join(backends)} at once")
        stop = threading.Event()
        rtts = _at_once(lambda ls: echo_round_trips(*ls, samples, stop=stop), list(zip(links, servers)), stop)
        expected = expected_round_trip(profile)
        rows = [ValidationRow(link.backend, profile.name, profile.seed, Quantiles.of(r), expected, profile.rate_mbit)
                for link, r in zip(links, rtts)]
        for row, link, server in zip(rows, links, servers):
            if bulk_bytes:
                say(f"{profile.name}/{link.backend}: bulk transfer of {bulk_bytes / 1e6:.1f} MB")
                row.down_mbit = bulk_throughput(link, server, bulk_bytes, "down")
                if up:
                    row.up_mbit = bulk_throughput(link, server, bulk_bytes, "up")
            if grpc_samples:
                say(f"{profile.name}/{link.backend}: {grpc_samples} gRPC round trips")
                grpc_server = GrpcProbeServer(link)
                try:
                    row.grpc = Quantiles.of(grpc_round_trips(link, grpc_server, grpc_samples))
                finally:
                    grpc_server.close()
            row.stats = link.stats()
        return rows
    finally:
        for server in servers:
            server.close()
        for link in links:
            link.stop()


def _at_once(fn, items: list, stop: threading.Event | None = None) -> list:
    """`fn(item)` for every item at the same time, each on a daemon thread; the results in order.
    `stop` is set once a call raises or the caller is interrupted (Ctrl-C, SIGTERM), which does not
    wait for the threads: a probe blocked on a link that is being removed (a connect in flight)
    would hold the exit for its whole timeout.

    Raises:
        The first exception a call raised, in the order of `items`.
    """
    stop = threading.Event() if stop is None else stop
    results, errors = [None] * len(items), [None] * len(items)

    def run(i: int) -> None:
        try:
            results[i] = fn(items[i])
        except Exception as err:  # raised below, in the caller's thread
            errors[i] = err
            stop.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True, name="netsim-probe") for i in range(len(items))]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    finally:
        stop.set()
    for err in errors:
        if err is not None:
            raise err
    return results


def _validate_offline(profile: LinkProfile, links: list[Link], servers: list[ProbeServer],
                      say) -> list[ValidationRow]:
    """The rows of an offline profile: each link must black-hole a connection (checked at once).

    Raises:
        RuntimeError: something came back across a link."""
    backends = ", ".join(link.backend for link in links)
    say(f"{profile.name}: loss 100%, nothing to measure; checking that nothing comes back across {backends}")
    silent = _at_once(lambda ls: black_hole(*ls), list(zip(links, servers)))
    leaky = [link.backend for link, ok in zip(links, silent) if not ok]
    if leaky:
        raise RuntimeError(f"profile {profile.name} is offline, yet an answer crossed the {', '.join(leaky)} link")
    return [ValidationRow(link.backend, profile.name, profile.seed, None, None, profile.rate_mbit, stats=link.stats())
            for link in links]


def agreement(a: Quantiles, b: Quantiles) -> dict[str, float]:
    """Relative differences |a - b| / b of p50 and p99."""
    return {"p50": abs(a.p50 - b.p50) / b.p50, "p99": abs(a.p99 - b.p99) / b.p99}


def format_table(rows: list[ValidationRow]) -> str:
    """Markdown table: round trip p50/p90/p99 (ms) against the profile's, throughput against rate.
    An offline profile's row has "-" for the round trips and "offline" for the expected ones."""
    def num(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    lines = ["| profile | backend | RTT p50 | p90 | p99 | max | expected p50 / p99 | down Mbit/s | up Mbit/s "
             "| rate | gRPC p50 / p99 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        grpc = "-" if r.grpc is None else f"{r.grpc.p50:.2f} / {r.grpc.p99:.2f}"
        if r.rtt is None:
            rtt = "- | - | - | - | offline"
        else:
            rtt = (f"{r.rtt.p50:.2f} | {r.rtt.p90:.2f} | {r.rtt.p99:.2f} | {r.rtt.max:.1f} "
                   f"| {r.expected_rtt.p50:.2f} / {r.expected_rtt.p99:.2f}")
        lines.append(f"| {r.profile} | {r.backend} | {rtt} | {num(r.down_mbit)} | {num(r.up_mbit)} "
                     f"| {num(r.rate_mbit, '{:g}')} | {grpc} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`grpc-client ADDRESS SAMPLES WARMUP`: the client half of `grpc_round_trips` (JSON on stdout)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 4 or argv[0] != "grpc-client":
        print("usage: python -m splitspec.netsim.validate grpc-client ADDRESS SAMPLES WARMUP", file=sys.stderr)
        return 2
    print(json.dumps(_grpc_client(argv[1], int(argv[2]), int(argv[3]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
