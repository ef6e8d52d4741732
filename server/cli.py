"""The server's command: `splitspec serve`.

`add_server_parsers` adds it to the top-level parser (cli/main.py); its flags become the
`ServerLimits` and `ServerSecurity` here, in one place. The model stack and the gRPC service load
when the command runs, so that `splitspec --help` stays quick.
"""
from __future__ import annotations

import argparse
import asyncio
from functools import partial
from pathlib import Path

from splitspec.shared.compute import loaded_on_compute_thread
from splitspec.shared.config import (ServerLimits, ServerSecurity, parse_size, port_number, read_tokens,
                                     tokens_from_env)
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.models import DEFAULT_TARGET, check_device, load_model


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
                        "inside it (by each session's measured turnaround; a lone session never waits); 0 = off")
    p.add_argument("--batching", choices=["ragged", "padded"], default="ragged",
                   help="how steps share a forward: ragged (trees end to end, attention per session against its own "
                        "cache; used where the target's attention is SDPA's, else padded) or padded (caches copied "
                        "into rows padded to the longest; kept for comparison)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="run one-session verify steps of up to 64 rows as fixed-shape forwards replayed from CUDA "
                        "graphs (server/graphs.py; --device cuda only; batched steps stay eager)")
    p.add_argument("--keepalive", type=float, default=d.keepalive_time_s, help="ping interval, s")
    p.add_argument("--keepalive-timeout", type=float, default=d.keepalive_timeout_s, help="ping ack deadline, s")
    p.add_argument("--min-ping-interval", type=float, default=d.min_ping_interval_s,
                   help="clients may ping this often, s (must not exceed the clients' keepalive)")
    p.add_argument("--grace", type=float, default=5.0, help="on SIGTERM/SIGINT: seconds in-flight steps may finish")
    p.add_argument("--auth-token-file", default=None,
                   help="accepted bearer tokens, one per line (else $SPLITSPEC_AUTH_TOKENS; none = no auth)")
    p.add_argument("--tls-cert", default=None, help="PEM server certificate chain (enables TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="PEM CA that client certificates must chain to (mTLS)")
    p.add_argument("--metrics-port", type=port_number, default=None, help="export Prometheus metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1")


def server_limits(args) -> ServerLimits:
    """The ServerLimits of the serve flags. Raises ValueError: a limit that is not positive."""
    return ServerLimits(max_sessions=args.max_sessions, max_tree_nodes=args.max_tree_nodes,
                        max_context=args.max_context, session_idle_ttl_s=args.session_ttl,
                        max_receive_bytes=args.max_request_bytes, max_send_bytes=args.max_reply_bytes,
                        max_concurrent_streams=args.max_streams,
                        max_session_kv_tokens=args.max_session_kv_tokens,
                        max_session_kv_bytes=args.max_session_kv_bytes, max_total_kv_tokens=args.max_kv_tokens,
                        max_total_kv_bytes=args.max_kv_bytes, rate_limit_per_s=args.rate_limit or None,
                        rate_limit_burst=args.rate_burst, keepalive_time_s=args.keepalive,
                        keepalive_timeout_s=args.keepalive_timeout, min_ping_interval_s=args.min_ping_interval,
                        max_batch=args.max_batch, batch_window_ms=args.batch_window_ms)


def server_security(args) -> ServerSecurity:
    """ServerSecurity from the serve flags and $SPLITSPEC_AUTH_TOKENS (files read here, once)."""
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    tokens = read_tokens(args.auth_token_file) if args.auth_token_file else tokens_from_env()
    return ServerSecurity(tokens=tokens, tls_cert=read(args.tls_cert), tls_key=read(args.tls_key),
                          tls_client_ca=read(args.tls_client_ca))


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

    def build_runner() -> TargetRunner:
        model, tokenizer, model_id = load_model(args.target, device=args.device, dtype=args.dtype,
                                               linear=args.linear)
        lsa_modules = hosted_lsa_modules(args.lsa, args.target, model, tokenizer, model_id, args.device)
        runner = TargetRunner(model, tokenizer, model_id, lsa_modules, use_graphs=args.cuda_graphs)
        if args.batching == "padded":
            runner.ragged = False
        return runner

    # loaded on the thread that will run every model step: one OpenMP pool (shared/compute.py)
    worker, runner = loaded_on_compute_thread("target", build_runner)
    serve_kw = dict(security=security, grace_s=args.grace, metrics_port=args.metrics_port,
                    metrics_host=args.metrics_host, worker=worker)
    if args.link is None:
        asyncio.run(serve(runner, args.host, args.port, limits, **serve_kw))
        return
    if behind_link is None:
        raise RuntimeError("--link needs splitspec.netsim (run the `splitspec` command)")
    behind_link(lambda host, port, on_bound: serve(runner, host, port, limits, on_bound=on_bound, **serve_kw),
                args.link, args.backend, args.host, args.port)
