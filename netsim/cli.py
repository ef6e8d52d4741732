"""`splitspec netsim ...`: probe the backends, put a server behind a link, validate the backends.

    splitspec netsim probe
    splitspec netsim run --profile 4g [--backend tun] [--seed 1] [--cut 50s:10s] [--client CMD] -- SERVER...
    splitspec netsim validate --profile 4g,lan --backends relay,tun
    splitspec netsim cleanup

`run` semantics: SERVER is started on the link's server side (in the server namespace for tun and
netem, on this host for relay) and must listen where it is told: `{host}` and `{port}` in its
arguments are replaced by that address, which also is in the environment as SPLITSPEC_LISTEN_HOST
and SPLITSPEC_LISTEN_PORT. For tun and netem that is the server namespace's address and --port;
for relay it is a private loopback port, and the relay listens on 127.0.0.1:--port. Clients use the
address printed (and given as `{server}` / SPLITSPEC_SERVER), from the client side: for tun and netem
inside the client namespace (`ip netns exec ss-cli-... CMD`, printed), for relay from this host.
With --client CMD the client command is run there once the server listens, and `run` exits with
its status; without it, `run` lasts until the server exits or Ctrl-C (a command killed by signal N
gives 128 + N, as a shell does). SPLITSPEC_NETSIM holds `link.describe()` as JSON for both commands,
so their result files can record backend, profile and seed; --record FILE writes it with the
commands (as run, `{host}`, `{port}` and `{server}` replaced; as given in `*_template`), exit status
and applied cuts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import socket
import sys
from pathlib import Path

from .backends import BACKENDS, RelayBackend, choose_backend, make_link, probe_backends, wait_for_port
from .profiles import LinkProfile, load_profile
from .schedule import CutSchedule, ScheduledCuts
from .validate import MIN_BULK_BYTES, format_table, validate

BACKEND_CHOICES = ("auto", *BACKENDS)
MIN_BULK_MB = MIN_BULK_BYTES / 1e6


def add_netsim_parser(sub) -> None:
    """Register `netsim` and its subcommands on an argparse subparsers object."""
    p = sub.add_parser("netsim", help="emulated network links: probe, run a server behind one, validate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    netsim = p.add_subparsers(dest="netsim_command", required=True)

    q = netsim.add_parser("probe", help="which backends can run here, and why not")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_probe)

    q = netsim.add_parser("run", help="run a server command behind an emulated link")
    _add_link_args(q)
    q.add_argument("--port", type=_port, default=50051,
                   help="the port clients connect to (0: a free one, printed when the server listens)")
    q.add_argument("--cut", default=None, metavar="AT:DURATION,...",
                   help="cut the link on a schedule from when the server listens, e.g. 50s:10s,2m:5s")
    q.add_argument("--client", default=None, metavar="CMD",
                   help="client command line to run on the client side once the server listens; "
                        "{server} is replaced by the address; exit with its status")
    q.add_argument("--wait", type=_seconds, default=600.0, help="seconds to wait for the server to listen")
    q.add_argument("--record", default=None, metavar="FILE", help="write the link, commands and outcome as JSON")
    q.add_argument("server", nargs=argparse.REMAINDER, metavar="-- SERVER...",
                   help="server command; {host} and {port} are replaced by where it must listen")
    q.set_defaults(func=cmd_run)

    q = netsim.add_parser("validate", help="measure round trips and throughput on several backends")
    q.add_argument("--profile", default="4g", help="comma-separated presets or .toml files")
    q.add_argument("--backends", default="relay,tun", help="comma-separated backends to compare")
    q.add_argument("--seed", type=int, default=None, help="override the profiles' seed")
    q.add_argument("--samples", type=_count(1), default=500, help="echo round trips per backend (>= 500 for p99)")
    q.add_argument("--bulk-mb", type=_bulk_mb, default=None,
                   help=f"MB per bulk transfer (default: 2 s at the profile's rate; at least {MIN_BULK_MB}); "
                        "0 skips it")
    q.add_argument("--up", action="store_true", help="also measure client-to-server throughput")
    q.add_argument("--grpc", type=_count(0), default=200, metavar="N", help="gRPC round trips per backend; 0 skips")
    q.add_argument("--json", default=None, metavar="FILE", help="also write every row as JSON lines")
    q.set_defaults(func=cmd_validate)

    q = netsim.add_parser("cleanup", help="remove namespaces left by splitspec processes that died")
    q.set_defaults(func=cmd_cleanup)


def _count(least: int):
    """argparse type of an integer >= `least` (raises argparse.ArgumentTypeError otherwise)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{n} must be >= {least}")
        return n

    return parse


def _port(text: str) -> int:
    """argparse type of a TCP port, 0..65535 (0: any free one); netsim imports no other room, so
    this is its own copy of shared/config.py `port_number`.

    Raises:
        argparse.ArgumentTypeError: not an integer, or outside 0..65535.
    """
    port = _count(0)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"{port} must lie in 0..65535")
    return port


def _seconds(text: str) -> float:
    """argparse type of a finite number of seconds >= 0.

    Raises:
        argparse.ArgumentTypeError: not a number, negative, infinite or NaN.
    """
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of seconds >= 0")
    return seconds


def _bulk_mb(text: str) -> float:
    """argparse type of --bulk-mb: 0 (skip the transfers) or at least MIN_BULK_MB.

    Raises:
        argparse.ArgumentTypeError: not a number, or neither 0 nor a transfer `bulk_throughput` takes.
    """
    try:
        mb = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if mb != 0 and not (math.isfinite(mb) and mb >= MIN_BULK_MB):
        raise argparse.ArgumentTypeError(f"{text} must be 0 (skip) or at least {MIN_BULK_MB} MB")
    return mb


def _add_link_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="lan, wifi, 5g, 4g, offline or a .toml file")
    p.add_argument("--backend", default="auto", choices=BACKEND_CHOICES,
                   help="auto = the most faithful one this host can run (see `splitspec netsim probe`)")
    p.add_argument("--seed", type=int, default=None, help="override the profile's seed")


def _profile(spec: str, seed: int | None) -> LinkProfile:
    profile = load_profile(spec)
    return profile if seed is None else profile.with_seed(seed)


def cmd_probe(args) -> int:
    status = probe_backends()
    if args.json:
        print(json.dumps({name: {"available": s.available, "reason": s.reason} for name, s in status.items()}))
        return 0
    chosen = choose_backend()
    for name, s in status.items():
        mark = "yes" if s.available else "no "
        print(f"{name:6} {mark}  {s.reason}{'  (auto picks this)' if name == chosen else ''}")
    return 0


def _substitute(argv: list[str], values: dict[str, str]) -> list[str]:
    out = []
    for arg in argv:
        for key, value in values.items():
            arg = arg.replace("{" + key + "}", value)
        out.append(arg)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_status(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128 + N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _raise_on_sigterm() -> None:
    """SIGTERM unwinds this process (so the link is removed); a forked child just exits."""
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            os._exit(128 + signum)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def cmd_run(args) -> int:
    server_argv = args.server[1:] if args.server[:1] == ["--"] else args.server
    if not server_argv:
        raise ValueError("give the server command after --, e.g. -- splitspec serve --host {host} --port {port}")
    schedule = CutSchedule.parse(args.cut)
    client_argv = shlex.split(args.client) if args.client else None
    profile = _profile(args.profile, args.seed)
    backend = choose_backend(args.backend)
    if args.record:
        _check_writable(args.record, "--record")
    link = make_link(profile, backend)
    record = {"link": link.describe(), "server": server_argv, "client": client_argv, "cuts": str(schedule),
              "server_template": server_argv, "client_template": client_argv}
    _raise_on_sigterm()
    with link:
        record["link"] = link.describe()
        # the relay's server listens on a free port behind it; in a namespace (tun) any port is free,
        # but --port 0 cannot be waited for there, so it gets one picked the same way
        port = _free_port() if backend == "relay" or args.port == 0 else args.port
        address = link.expose(port, listen_port=args.port) if isinstance(link, RelayBackend) else link.expose(port)
        values = {"host": link.server_host, "port": str(port), "server": address}
        env = {**os.environ, "SPLITSPEC_LISTEN_HOST": link.server_host, "SPLITSPEC_LISTEN_PORT": str(port),
               "SPLITSPEC_SERVER": address, "SPLITSPEC_NETSIM": json.dumps(record["link"])}
        record["server"] = _substitute(server_argv, values)
        server = link.popen(record["server"], "server", env=env)
        wait_for_port(link, port, args.wait, proc=server)
        print(f"netsim: {profile.name} over the {backend} backend (seed {profile.seed}): the server listens on "
              f"{link.server_host}:{port}; clients connect to {address}", file=sys.stderr, flush=True)
        if link.namespaces["client"]:
            print(f"netsim: run clients with: {link.client_hint(['CMD', '--server', address])}",
                  file=sys.stderr, flush=True)
        cuts = ScheduledCuts(link, schedule).start()
        try:
            if client_argv:
                record["client"] = _substitute(client_argv, values)
                client = link.popen(record["client"], "client", env=env)
                record["exit"] = _exit_status(client.wait())
            else:
                record["exit"] = _exit_status(server.wait())
        finally:
            cuts.stop()
            record["applied_cuts"] = cuts.log
            record["stats"] = _safe_stats(link)
            if args.record:
                Path(args.record).write_text(json.dumps(record, indent=1) + "\n")
    return record["exit"]


def _check_writable(path: str, flag: str) -> None:
    """Before a run: the file `path` can be written (it is opened for appending, so an existing one
    stays as it is until the run writes it); the run's outcome was lost to a bad path at its end.

    Raises:
        OSError: naming `flag`, the path and why.
    """
    try:
        with open(path, "a"):
            pass
    except OSError as err:
        raise OSError(f"{flag} {path}: cannot write it ({err.strerror or err})") from None


def _safe_stats(link) -> dict:
    try:
        return link.stats()
    except (RuntimeError, OSError) as err:
        return {"error": str(err)}


def cmd_validate(args) -> int:
    """The numbers are checked by argparse, the backends and profiles here, before any link is
    built. SIGTERM, like Ctrl-C, stops the probes and removes the links."""
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for backend in backends:
        choose_backend(backend)  # refuse early, with the reason
    profiles = [_profile(spec.strip(), args.seed) for spec in args.profile.split(",")]
    if args.json:
        _check_writable(args.json, "--json")
    bulk = None if args.bulk_mb is None else round(args.bulk_mb * 1e6)
    _raise_on_sigterm()
    rows = []
    for profile in profiles:
        rows += validate(profile, backends, args.samples, bulk, args.grpc, args.up,
                         progress=lambda msg: print(f"netsim validate: {msg}", file=sys.stderr, flush=True))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row.to_dict()) + "\n")
    return 0


def cmd_cleanup(args) -> int:
    from .namespaces import remove_stale_namespaces

    removed = remove_stale_namespaces()
    print("removed: " + (", ".join(removed) if removed else "nothing"))
    return 0


def serve_behind_link(serve, spec: str, backend: str | None, host: str, port: int) -> None:
    """Run an in-process service behind an emulated link until it returns (SIGINT/SIGTERM).

    `serve(host, port, on_bound)` returns the service coroutine; `on_bound(bound_port)` is called
    once it listens. relay: the service binds a private loopback port, the relay listens on
    host:port. tun / netem: the service listens on the server namespace's address and `port`
    (this thread enters that namespace; `host` is not used), clients reach it from the client
    namespace. Raises RuntimeError when the backend cannot run here.
    """
    profile = load_profile(spec)
    name = choose_backend(backend or "relay")
    link = RelayBackend(profile, listen_host=host) if name == "relay" else make_link(profile, name)

    def announce(address: str) -> None:
        where = f"from namespace {link.namespaces['client']}" if link.namespaces["client"] else "from this host"
        print(f"emulated link {profile.name} ({name} backend, seed {profile.seed}): clients connect to {address} "
              f"{where}", flush=True)
        if link.namespaces["client"]:
            print(f"e.g. {link.client_hint(['splitspec', 'generate', '--server', address, '--prompt', '...'])}",
                  flush=True)

    with link:
        if name == "relay":
            async def behind_relay() -> None:
                bound = asyncio.get_running_loop().create_future()
                service = asyncio.create_task(serve("127.0.0.1", 0, bound.set_result))
                await asyncio.wait({service, bound}, return_when=asyncio.FIRST_COMPLETED)
                if bound.done():  # else the service failed before listening: await raises why
                    announce(link.expose(bound.result(), listen_port=port))
                await service

            asyncio.run(behind_relay())
            return
        with link.server_side():
            asyncio.run(serve(link.server_host, port, lambda bound: announce(link.expose(bound))))


def main(argv: list[str] | None = None) -> int:
    """`python -m splitspec.netsim.cli SUBCOMMAND ...`: the same as `splitspec netsim ...`, without
    importing the model stack."""
    parser = argparse.ArgumentParser(prog="python -m splitspec.netsim.cli")
    add_netsim_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["netsim", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as err:
        print(f"splitspec netsim: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
