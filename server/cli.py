"""The server's command: `splitspec serve`.

`add_server_parsers` adds it to the top-level parser (cli/main.py); its flags become the
`ServerLimits` and `ServerSecurity` here, in one place. The model stack and the gRPC service load
when the command runs, so that `splitspec --help` stays quick.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from functools import partial
from pathlib import Path

from splitspec.shared.compute import loaded_on_compute_thread
from splitspec.shared.config import (CALLS_PER_SESSION, CALLS_SPARE, CLIENT_KEEPALIVE_TIME_S, ServerLimits,
                                     ServerSecurity, at_least, parse_size, port_number, read_tokens,
                                     tokens_from_env)
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.models import DEFAULT_TARGET, check_device, load_model

log = logging.getLogger(__name__)


def add_server_parsers(sub, behind_link=None) -> None:
    """serve. `behind_link(serve, profile, backend, host, port)`: runs the service behind an emulated
    link for --link; the composition root passes netsim/cli.py's `serve_behind_link`."""
    p = sub.add_parser("serve", help="run the verify service")
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, Hugging Face id or local path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=50051)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--linear", default="auto", choices=["auto", "onednn", "torch"],
                   help="CPU linear layers: oneDNN with prepacked weights (auto: where it works) or torch's "
                        "nn.Linear; env SPLITSPEC_LINEAR sets auto's choice for every command")
    p.add_argument("--max-sessions", type=int, default=ServerLimits.max_sessions)
    p.add_argument("--max-tree-nodes", type=int, default=ServerLimits.max_tree_nodes)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--session-ttl", type=float, default=ServerLimits.session_idle_ttl_s, help="idle seconds")
    p.add_argument("--link", default=None, metavar="PROFILE",
                   help="serve behind an emulated link: lan, wifi, 5g, 4g, offline or a .toml file")
    p.add_argument("--backend", default="relay", choices=["auto", "relay", "tun", "netem"],
                   help="--link backend; tun/netem (root) put the service in a network namespace")
    p.add_argument("--lsa", action="append", default=[], metavar="DRAFTER",
                   help="host this MoA drafter's LSA for clients with --lsa-placement server: moa[:tli=N|:PATH]")
    _add_service_args(p)
    p.set_defaults(func=partial(cmd_serve, behind_link=behind_link))


def _add_service_args(p: argparse.ArgumentParser) -> None:
    """serve: limits, keepalive, auth/TLS and metrics flags (sizes accept K/M/G suffixes)."""
    d = ServerLimits
    p.add_argument("--max-request-bytes", type=parse_size, default=d.max_receive_bytes, help="largest request message")
    p.add_argument("--max-reply-bytes", type=parse_size, default=d.max_send_bytes, help="largest reply message")
    p.add_argument("--max-streams", type=int, default=d.max_concurrent_streams,
                   help="concurrent calls per client connection (HTTP/2 streams; more wait on the client)")
    p.add_argument("--max-calls", type=int, default=None,
                   help="calls in flight over all connections (health calls apart); more are refused with "
                        "RESOURCE_EXHAUSTED and a retry hint "
                        f"(default: {CALLS_PER_SESSION} per --max-sessions + {CALLS_SPARE})")
    p.add_argument("--max-session-kv-tokens", type=int, default=None, help="KV budget per session, tokens")
    p.add_argument("--max-session-kv-bytes", type=parse_size, default=None, help="KV budget per session, bytes")
    p.add_argument("--max-kv-tokens", type=int, default=None, help="KV budget over all sessions, tokens")
    p.add_argument("--max-kv-bytes", type=parse_size, default=d.max_total_kv_bytes, help="KV budget over all sessions, bytes")
    p.add_argument("--rate-limit", type=float, default=0.0,
                   help="OpenSession/Verify calls per second per client (token, else certificate, else address); "
                        "0 = off (the default: one worker already bounds throughput; e.g. 50 on a shared server)")
    p.add_argument("--rate-burst", type=int, default=d.rate_limit_burst, help="calls a client may make at once")
    p.add_argument("--max-batch", type=int, default=d.max_batch,
                   help="Verify steps of different sessions scored in one forward (those queued when the model "
                        "worker gets free); 1 = one step per forward")
    p.add_argument("--batch-window-ms", type=float, default=d.batch_window_ms,
                   help="a free model worker waits up to this long for the next steps of the other sessions due "
                        "inside it (by each session's measured turnaround; a lone session never waits); 0 = off, at most 1000")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help="prefill prompts in forwards of at most this many tokens, scoring the verify steps of other "
                        "sessions queued meanwhile between them (chunked prefill); 0 = one forward per prompt")
    p.add_argument("--batching", choices=["ragged", "padded"], default="ragged",
                   help="how steps share a forward: ragged (trees end to end, attention per session against its own "
                        "cache; used where the target's attention is SDPA's, else padded) or padded (caches copied "
                        "into rows padded to the longest; kept for comparison)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="run one-session verify steps of up to 64 rows as fixed-shape forwards replayed from CUDA "
                        "graphs (server/graphs.py; --device cuda only; batched steps stay eager)")
    p.add_argument("--keepalive", type=float, default=d.keepalive_time_s, help="ping interval, s")
    p.add_argument("--keepalive-timeout", type=float, default=d.keepalive_timeout_s, help="ping ack deadline, s")
    p.add_argument("--min-ping-interval", type=min_ping_interval, default=d.min_ping_interval_s,
                   help=f"clients may ping this often, s (at most the splitspec client's keepalive, "
                        f"{CLIENT_KEEPALIVE_TIME_S:g} s)")
    p.add_argument("--grace", type=at_least(0, finite=True), default=5.0,
                   help="on SIGTERM/SIGINT: seconds in-flight steps may finish")
    p.add_argument("--auth-token-file", default=None,
                   help="accepted bearer tokens, one per line (else $SPLITSPEC_AUTH_TOKENS; none = no auth)")
    p.add_argument("--tls-cert", default=None, help="PEM server certificate chain (enables TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="PEM CA that client certificates must chain to (mTLS)")
    p.add_argument("--metrics-port", type=port_number, default=None, help="export Prometheus metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1")


def min_ping_interval(text: str) -> float:
    """argparse type of --min-ping-interval: finite seconds > 0, at most the splitspec client's
    keepalive interval (`CLIENT_KEEPALIVE_TIME_S`). A longer one makes the server count each
    keepalive ping of an idle client as a strike and, after `max_ping_strikes`, close its
    connection with GOAWAY too_many_pings (a call in flight then fails with UNAVAILABLE).

    Raises:
        argparse.ArgumentTypeError: out of range.
    """
    seconds = at_least(0, strict=True, finite=True)(text)
    if seconds > CLIENT_KEEPALIVE_TIME_S:
        raise argparse.ArgumentTypeError(
            f"must be <= {CLIENT_KEEPALIVE_TIME_S:g}, got {text}: splitspec clients ping every "
            f"{CLIENT_KEEPALIVE_TIME_S:g} s, and the server would count each of those pings as a strike "
            "and close idle clients' connections (GOAWAY too_many_pings)")
    return seconds


min_ping_interval.__name__ = "float"  # argparse: "invalid float value" for text that is no number


def server_limits(args) -> ServerLimits:
    """The ServerLimits of the serve flags. Raises ValueError: a limit that is not positive."""
    return ServerLimits(max_sessions=args.max_sessions, max_tree_nodes=args.max_tree_nodes,
                        max_context=args.max_context, session_idle_ttl_s=args.session_ttl,
                        max_receive_bytes=args.max_request_bytes, max_send_bytes=args.max_reply_bytes,
                        max_concurrent_streams=args.max_streams, max_calls=args.max_calls,
                        max_session_kv_tokens=args.max_session_kv_tokens,
                        max_session_kv_bytes=args.max_session_kv_bytes, max_total_kv_tokens=args.max_kv_tokens,
                        max_total_kv_bytes=args.max_kv_bytes, rate_limit_per_s=args.rate_limit or None,
                        rate_limit_burst=args.rate_burst, keepalive_time_s=args.keepalive,
                        keepalive_timeout_s=args.keepalive_timeout, min_ping_interval_s=args.min_ping_interval,
                        max_batch=args.max_batch, batch_window_ms=args.batch_window_ms,
                        prefill_chunk=args.prefill_chunk or None)


def server_security(args) -> ServerSecurity:
    """ServerSecurity from the serve flags and $SPLITSPEC_AUTH_TOKENS (files read here, once)."""
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    tokens = read_tokens(args.auth_token_file) if args.auth_token_file else tokens_from_env()
    security = ServerSecurity(tokens=tokens, tls_cert=read(args.tls_cert), tls_key=read(args.tls_key),
                              tls_client_ca=read(args.tls_client_ca))
    if security.tls:  # gRPC would only say "Failed to bind", after the model loads
        from .auth import check_tls

        for warning in check_tls(security.tls_cert, security.tls_key, security.tls_client_ca,
                                 cert_name=f"--tls-cert {args.tls_cert}", key_name=f"--tls-key {args.tls_key}",
                                 ca_name=f"--tls-client-ca {args.tls_client_ca}"):
            log.warning("%s", warning)
    return security


_ANY_HOST = ("", "0.0.0.0", "::", "[::]")


def reserve_metrics_port(host: str, port: int | None, service_host: str, service_port: int) -> socket.socket | None:
    """Bind and listen on the metrics address now, before the model loads, so that a busy
    --metrics-port fails at once, naming host:port, instead of after the verify service has been
    announced and started; the returned socket holds the port until it is closed (just before
    `serve` binds it). None for no metrics or port 0 (any free port).

    Raises:
        ValueError: --metrics-port is the service's own --port.
        OSError: the address cannot be bound (message "metrics port HOST:PORT: ...").
    """
    if not port:
        return None
    if port == service_port and (host == service_host or host in _ANY_HOST or service_host in _ANY_HOST):
        raise ValueError(f"--metrics-port {port} is also the verify service's --port; give the metrics another port")
    return _reserve(host, port, "metrics port", "--metrics-host/--metrics-port")


def reserve_service_port(host: str, port: int) -> socket.socket | None:
    """As `reserve_metrics_port`, for the verify service's own --port (None for port 0): a busy
    port was found only after the model had loaded ("Failed to bind to address")."""
    return _reserve(host, port, "port", "--host/--port") if port else None


def _reserve(host: str, port: int, what: str, flags: str) -> socket.socket:
    """A socket bound and listening on host:port (SO_REUSEADDR, as the servers bind).

    Raises:
        OSError: it cannot be bound, "WHAT HOST:PORT: why (FLAGS)".
    """
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as err:
        raise OSError(f"{what} {shown}: {err.strerror or err} ({flags})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1)  # a listening socket keeps other processes off the port while the model loads
    except OSError as err:
        sock.close()
        why = (err.strerror or str(err)).lower()
        raise OSError(f"{what} {shown}: {why} ({flags})") from None
    return sock


def hosted_lsa_modules(names: list[str], target: str, model, tokenizer, model_id: str, device: str) -> dict:
    """checkpoint id -> MoA module of each --lsa drafter, for the TargetRunner to run LSA with.

    Raises:
        ValueError: a name that is not a moa drafter, or whose checkpoint holds another kind.
        CheckpointMismatch: a checkpoint trained for another target.
    """
    from splitspec.shared.drafters.checkpoint import TargetIdentity, checkpoint_id, load_checkpoint
    from splitspec.shared.packed_linear import pack_linears

    identity = TargetIdentity.of(model, tokenizer, model_id)
    modules = {}
    for name in names:
        path = DrafterSpec.parse(name).checkpoint(target)
        kind, module, _ = load_checkpoint(path, identity, dtype=model.dtype)
        if kind != "moa":
            raise ValueError(f"--lsa {name}: {path} is a {kind} checkpoint, not moa")
        module = module.to(device)
        if device == "cpu":
            pack_linears(module)  # LSA runs over every committed position's layer stack each step
        modules[checkpoint_id(path)] = module
    return modules


def cmd_serve(args, behind_link=None) -> None:
    """Raises RuntimeError: --link without a `behind_link` runner; ValueError: --device cuda where
    torch has no CUDA (`check_device`, before the model loads); see also the helpers above."""
    from .runner import TargetRunner
    from .service import serve

    if args.cuda_graphs and args.device != "cuda":
        raise ValueError("--cuda-graphs needs --device cuda (on a CPU the fixed-shape step only costs more)")
    check_device(args.device)
    limits, security = server_limits(args), server_security(args)  # bad flags fail before the model loads
    metrics_hold = reserve_metrics_port(args.metrics_host, args.metrics_port, args.host, args.port)
    try:  # behind an emulated link the service binds elsewhere (netsim)
        service_hold = reserve_service_port(args.host, args.port) if args.link is None else None
    except OSError:
        if metrics_hold is not None:
            metrics_hold.close()
        raise

    def build_runner() -> TargetRunner:
        model, tokenizer, model_id = load_model(args.target, device=args.device, dtype=args.dtype,
                                               linear=args.linear)
        lsa_modules = hosted_lsa_modules(args.lsa, args.target, model, tokenizer, model_id, args.device)
        runner = TargetRunner(model, tokenizer, model_id, lsa_modules, use_graphs=args.cuda_graphs)
        if args.batching == "padded":
            runner.ragged = False
        return runner

    # loaded on the thread that will run every model step: one OpenMP pool (shared/compute.py)
    try:
        worker, runner = loaded_on_compute_thread("target", build_runner)
    finally:
        for hold in (metrics_hold, service_hold):
            if hold is not None:
                hold.close()  # serve binds it next
    # SIGHUP reads the token file again (rotation without a restart)
    reload_tokens = partial(read_tokens, args.auth_token_file) if args.auth_token_file and security.tokens else None
    serve_kw = dict(security=security, grace_s=args.grace, metrics_port=args.metrics_port,
                    metrics_host=args.metrics_host, worker=worker, reload_tokens=reload_tokens)
    if args.link is None:
        asyncio.run(serve(runner, args.host, args.port, limits, **serve_kw))
        return
    if behind_link is None:
        raise RuntimeError("--link needs splitspec.netsim (run the `splitspec` command)")
    behind_link(lambda host, port, on_bound: serve(runner, host, port, limits, on_bound=on_bound, **serve_kw),
                args.link, args.backend, args.host, args.port)
