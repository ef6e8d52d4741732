"""The `splitspec` command: pull, serve, generate, chat, bench.

All configuration is built from the command line here, in one place.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from dataclasses import asdict, dataclass

import grpc

from splitspec.client.drafters import DEFAULT_DRAFT_VOCAB
from splitspec.shared.config import ServerLimits, TreeConfig
from splitspec.shared.models import DEFAULT_TARGET
from splitspec.shared.sampling import SamplingParams
from splitspec.v1 import verify_pb2 as pb

FEATURE_QUANT = {"fp16": pb.QUANTIZATION_NONE, "int8": pb.QUANTIZATION_INT8, "fp8": pb.QUANTIZATION_FP8_E4M3}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as err:
        print(f"splitspec: error: {err}", file=sys.stderr)
        return 2
    except grpc.RpcError as err:
        print(f"splitspec: error: the verify service answered {err.code().name}: {err.details()}", file=sys.stderr)
        return 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="obtain a model and cache a converted copy")
    p.add_argument("model", nargs="?", default=DEFAULT_TARGET)
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("serve", help="run the verify service")
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, Hugging Face id or local path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    _add_device_args(p)
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
    p.set_defaults(func=cmd_serve)

    for name, helptext in (("generate", "generate one answer"), ("chat", "multi-turn terminal chat")):
        p = sub.add_parser(name, help=helptext)
        _add_client_args(p)
        if name == "generate":
            p.add_argument("--prompt", required=True)
            p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
            p.set_defaults(func=cmd_generate)
        else:
            p.add_argument("--history", default=None, help="chat history SQLite file "
                           "(default ~/.local/share/splitspec/chat.sqlite3)")
            p.add_argument("--resume", action="store_true", help="continue the last conversation in --history")
            p.set_defaults(func=cmd_chat)

    from .bench import add_bench_parser
    from .demo import add_demo_parser
    from .offline_eval import add_offline_eval_parser
    from splitspec.netsim.cli import add_netsim_parser

    add_bench_parser(sub)
    add_demo_parser(sub)
    add_offline_eval_parser(sub)
    add_netsim_parser(sub)
    _add_train_parser(sub)
    _add_draft_vocab_parser(sub)
    return parser


def _add_draft_vocab_parser(sub) -> None:
    p = sub.add_parser("draft-vocab", help="count the target's tokens in ShareGPT responses for the draft vocabulary")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--data", default="sharegpt", choices=["sharegpt"])
    p.add_argument("--max-len", type=int, default=2048, help="tokens counted per conversation")
    p.add_argument("--limit", type=int, default=None, help="count only this many training conversations")
    p.add_argument("--out", default=None, help="default: client/checkpoints/<target>/token_counts.safetensors")
    p.set_defaults(func=cmd_draft_vocab)


def cmd_draft_vocab(args) -> None:
    from pathlib import Path

    from splitspec.client.drafters import target_folder
    from splitspec.shared.drafters.draft_vocab import COUNTS
    from splitspec.train.vocab import make_counts

    out = Path(args.out) if args.out else target_folder(args.target) / COUNTS
    result = make_counts(args.target, out, max_len=args.max_len, limit=args.limit)
    print(json.dumps({"out": str(out), **result}))


def _add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a MoA or EAGLE-2 drafter by distillation from the target")
    p.add_argument("--drafter", required=True, choices=["moa", "eagle2"])
    p.add_argument("--tli", type=int, default=0, help="MoA Target Layer Inference: last N target layers reused")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--data", default="sharegpt", choices=["sharegpt"])
    p.add_argument("--max-tokens", type=int, default=200_000, help="training tokens per epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="conversations per optimizer step")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--eval-every", type=int, default=50, help="optimizer steps between held-out evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--resume", action="store_true")
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> None:
    from pathlib import Path

    from splitspec.train.trainer import TrainConfig, train

    cfg = TrainConfig(drafter=args.drafter, target=args.target, out=Path(args.out), tli=args.tli,
                      max_tokens=args.max_tokens, epochs=args.epochs, max_len=args.max_len, batch=args.batch,
                      lr=args.lr, eval_every=args.eval_every, seed=args.seed, device=args.device, resume=args.resume)
    print(json.dumps(train(cfg)))


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _add_client_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", default="127.0.0.1:50051", help="verify service HOST:PORT (split mode)")
    where.add_argument("--local", action="store_true", help="single-device mode: target in this process")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model for --local, and the tokenizer")
    p.add_argument("--drafter", default="auto",
                   help="auto | none | ngram | draft-model:MODEL[@layers=N] | moa[:tli=N|:PATH] | eagle2[:PATH]; "
                        "auto = the MoA checkpoint shipped for the target, else ngram")
    p.add_argument("--lsa-placement", default="client", choices=["client", "server"],
                   help="MoA: run Layer Self-Attention here (server sends all layers' K/V) or on the server")
    p.add_argument("--feature-quant", default="fp16", choices=sorted(FEATURE_QUANT),
                   help="quantization of the features the server sends")
    p.add_argument("--draft-vocab", type=int, default=-1,
                   help="moa/eagle2: draft among the N most frequent tokens (FR-Spec); 0 = the full vocabulary; "
                        f"default: {DEFAULT_DRAFT_VOCAB} when the target has shipped token counts")
    p.add_argument("--no-spec", action="store_true", help="baseline: one target call per token")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree-depth", type=int, default=TreeConfig.depth)
    p.add_argument("--tree-top-b", type=int, default=TreeConfig.top_b)
    p.add_argument("--tree-nodes", type=int, default=TreeConfig.max_nodes)
    p.add_argument("--system", default=None, help="system prompt (chat template)")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline of Info and OpenSession calls, s")
    p.add_argument("--step-timeout", type=float, default=10.0,
                   help="deadline of each Verify step, s; missing it continues offline")
    p.add_argument("--connect-timeout", type=float, default=10.0, help="wait for the server, s")
    p.add_argument("--on-reconnect", default="heal", choices=["heal", "keep"],
                   help="offline text the target rejects: replace it with the target's continuation, or keep it")
    p.add_argument("--no-offline", action="store_true",
                   help="fail when the server is unreachable instead of continuing with the drafter alone")
    p.add_argument("--private-ngram", type=int, default=2,
                   help="withhold drafts completing this many consecutive tokens of <private> text (1 = any)")
    p.add_argument("--auth-token-file", default=None, help="bearer token file (first token; else $SPLITSPEC_AUTH_TOKEN)")
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle to verify the server (enables TLS)")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate (mTLS; enables TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    _add_device_args(p)


def cmd_pull(args) -> None:
    from splitspec.shared.models import pull

    print(f"{args.model}: {pull(args.model)}")


def _add_service_args(p: argparse.ArgumentParser) -> None:
    """serve: limits, keepalive, auth/TLS and metrics flags (sizes accept K/M/G suffixes)."""
    from splitspec.shared.config import parse_size

    d = ServerLimits
    p.add_argument("--max-request-bytes", type=parse_size, default=d.max_receive_bytes, help="largest request message")
    p.add_argument("--max-reply-bytes", type=parse_size, default=d.max_send_bytes, help="largest reply message")
    p.add_argument("--max-session-kv-tokens", type=int, default=None, help="KV budget per session, tokens")
    p.add_argument("--max-session-kv-bytes", type=parse_size, default=None, help="KV budget per session, bytes")
    p.add_argument("--max-kv-tokens", type=int, default=None, help="KV budget over all sessions, tokens")
    p.add_argument("--max-kv-bytes", type=parse_size, default=d.max_total_kv_bytes, help="KV budget over all sessions, bytes")
    p.add_argument("--rate-limit", type=float, default=0.0,
                   help="OpenSession/Verify calls per second per client (token, else certificate, else address); "
                        "0 = off (the default: one worker already bounds throughput; e.g. 50 on a shared server)")
    p.add_argument("--rate-burst", type=int, default=d.rate_limit_burst, help="calls a client may make at once")
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
    p.add_argument("--metrics-port", type=int, default=None, help="export Prometheus metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1")


def _server_security(args):
    """ServerSecurity from the serve flags and $SPLITSPEC_AUTH_TOKENS (files read here, once)."""
    from pathlib import Path

    from splitspec.shared.config import ServerSecurity, read_tokens, tokens_from_env

    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    tokens = read_tokens(args.auth_token_file) if args.auth_token_file else tokens_from_env()
    return ServerSecurity(tokens=tokens, tls_cert=read(args.tls_cert), tls_key=read(args.tls_key),
                          tls_client_ca=read(args.tls_client_ca))


def cmd_serve(args) -> None:
    from splitspec.server.runner import TargetRunner
    from splitspec.server.service import serve
    from splitspec.shared.models import load_model

    serve_kw = dict(security=_server_security(args), grace_s=args.grace, metrics_port=args.metrics_port,
                    metrics_host=args.metrics_host)

    from splitspec.shared.drafters.checkpoint import TargetIdentity, checkpoint_id, load_checkpoint

    from .drafters import checkpoint_path

    model, tokenizer, model_id = load_model(args.target, device=args.device, dtype=args.dtype)
    identity = TargetIdentity.of(model, tokenizer, model_id)
    lsa_modules = {}
    for name in args.lsa:
        path = checkpoint_path(name, args.target)
        kind, module, _ = load_checkpoint(path, identity, dtype=model.dtype)
        if kind != "moa":
            raise ValueError(f"--lsa {name}: {path} is a {kind} checkpoint, not moa")
        lsa_modules[checkpoint_id(path)] = module.to(args.device)
    limits = ServerLimits(max_sessions=args.max_sessions, max_tree_nodes=args.max_tree_nodes,
                          max_context=args.max_context, session_idle_ttl_s=args.session_ttl,
                          max_receive_bytes=args.max_request_bytes, max_send_bytes=args.max_reply_bytes,
                          max_session_kv_tokens=args.max_session_kv_tokens,
                          max_session_kv_bytes=args.max_session_kv_bytes, max_total_kv_tokens=args.max_kv_tokens,
                          max_total_kv_bytes=args.max_kv_bytes, rate_limit_per_s=args.rate_limit or None,
                          rate_limit_burst=args.rate_burst, keepalive_time_s=args.keepalive,
                          keepalive_timeout_s=args.keepalive_timeout, min_ping_interval_s=args.min_ping_interval)
    runner = TargetRunner(model, tokenizer, model_id, lsa_modules)
    if args.link is None:
        asyncio.run(serve(runner, args.host, args.port, limits, **serve_kw))
        return
    from splitspec.netsim.cli import serve_behind_link

    serve_behind_link(lambda host, port, on_bound: serve(runner, host, port, limits, on_bound=on_bound, **serve_kw),
                      args.link, args.backend, args.host, args.port)


@dataclass
class ClientSetup:
    """What generate and chat need: the loop, the tokenizer, the sampling parameters."""

    decoder: object
    tokenizer: object
    sampling: SamplingParams
    mode: str


def build_client(args) -> ClientSetup:
    """Connect (or load the target locally), build the drafter, check tokenizer identity.

    Raises:
        TokenizerMismatch / ValueError: the client's tokenizer differs from the target's.
    """
    from splitspec.shared.models import load_model, load_tokenizer, tokenizer_fingerprint

    from .drafters import make_drafter
    from .loop import OfflinePolicy, SpeculativeDecoder

    if args.local:
        from splitspec.server.runner import TargetRunner

        from splitspec.server.local import LocalVerifier

        model, tokenizer, model_id = load_model(args.target, device=args.device, dtype=args.dtype)
        verifier = LocalVerifier(TargetRunner(model, tokenizer, model_id))
        mode = "single-device"
    else:
        from .transport import RemoteVerifier, load_client_security

        tokenizer = load_tokenizer(args.target)
        verifier = RemoteVerifier(args.server, args.timeout, args.connect_timeout, step_timeout_s=args.step_timeout,
                                  **load_client_security(args.auth_token_file, args.tls_ca, args.tls_cert, args.tls_key))
        mode = f"split via {args.server}"
        if tokenizer_fingerprint(tokenizer) != verifier.info.tokenizer_fingerprint:
            raise ValueError(f"the tokenizer of {args.target} differs from the server's target "
                             f"{verifier.info.model_id}; pass --target naming the server's model")
    tree = TreeConfig(depth=args.tree_depth, top_b=args.tree_top_b, max_nodes=args.tree_nodes)
    drafter = make_drafter("none" if args.no_spec else args.drafter,
                           target_fingerprint=verifier.info.tokenizer_fingerprint, tree=tree,
                           device=args.device, dtype=args.dtype, seed=args.seed, target=args.target,
                           target_model=verifier.runner.model if args.local else None,
                           lsa_placement=args.lsa_placement, quantization=FEATURE_QUANT[args.feature_quant],
                           draft_vocab=args.draft_vocab)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    policy = OfflinePolicy(enabled=not args.no_offline, on_reconnect=args.on_reconnect)
    return ClientSetup(SpeculativeDecoder(verifier, drafter, policy), tokenizer, sampling, mode)


class TextStream:
    """Prints the answer as stream events arrive (client/loop.py StreamEvent). Offline text (written
    by the drafter alone while the link is down) is dim until the target confirms it; private text
    (reproduced from a <private> span on this device) is underlined; when the target rewrites offline
    text, a marker shows where and the corrected text follows. Whole-answer decoding keeps
    multi-byte characters intact."""

    STYLE = {"offline": "\x1b[2m", "private": "\x1b[4m"}

    def __init__(self, tokenizer, out=sys.stdout) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.color = hasattr(out, "isatty") and out.isatty()
        self.ids: list[int] = []
        self.printed = 0  # characters of the decoded answer already written

    def __call__(self, event) -> None:
        if event.kind == "retract":
            del self.ids[event.start:]
            self.printed = len(self._text())
            self.out.write(" [link back: the target rewrote the offline text from here] ")
        elif event.kind == "kept":
            self.out.write(" [link back: offline text kept] ")
        elif event.kind == "tokens":
            self.ids.extend(event.tokens)
            text = self._text()
            if text.endswith("\ufffd"):  # an incomplete character: wait for its next byte
                return
            piece = text[self.printed:]
            style = self.STYLE.get(event.source) if self.color else None
            self.out.write(f"{style}{piece}\x1b[0m" if style and piece else piece)
            self.printed = len(text)
        self.out.flush()

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def _encode(setup: "ClientSetup", args, messages: list[dict[str, str]]):
    """Prompt ids and, when the messages hold <private> spans, the PrivacyGuard for them."""
    from .privacy import PrivacyGuard, encode_private_chat, placeholder_token

    ids, mask = encode_private_chat(setup.tokenizer, messages)
    guard = PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(setup.tokenizer), args.private_ngram)
    return ids, (guard if guard.active else None)


def _messages(args, history: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": args.system}] if args.system else []) + history


def cmd_generate(args) -> None:
    setup = build_client(args)
    prompt_ids, privacy = _encode(setup, args, _messages(args, [{"role": "user", "content": args.prompt}]))
    stream = None if args.json else TextStream(setup.tokenizer)
    gen = setup.decoder.generate(prompt_ids, args.max_new_tokens, setup.sampling, on_event=stream, privacy=privacy)
    text = setup.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"mode": setup.mode, "drafter": setup.decoder.drafter.name, "prompt_tokens": len(prompt_ids),
                          "token_ids": gen.tokens, "sources": gen.sources, "text": text,
                          "stopped_by_eos": gen.stopped_by_eos, "stats": gen.stats.as_dict(),
                          "calls": [asdict(c) for c in gen.stats.calls]}))
    else:
        print(f"\n{gen.stats.summary()}")
    setup.decoder.verifier.close()


def cmd_chat(args) -> None:
    from .history import ChatHistory, default_path

    setup = build_client(args)
    history_db = ChatHistory(args.history or default_path())
    conversation = history_db.last_conversation() if args.resume else None
    history: list[dict[str, str]] = []
    if conversation is not None:
        for m in history_db.messages(conversation):
            content = m["content"] if m["complete"] else history_db.recover(m["id"], setup.tokenizer)
            history.append({"role": m["role"], "content": content})
    else:
        conversation = history_db.new_conversation(args.target, setup.decoder.drafter.name)
    print(f"splitspec chat ({setup.mode}, drafter {setup.decoder.drafter.name}, history {history_db.path}, "
          f"{len(history)} earlier messages). Mark private text <private>like this</private>. /reset /stats /quit")
    last_stats = None
    while True:
        try:
            line = input("\nyou> ").strip()
        except EOFError:
            break
        if not line:
            continue
        if line == "/quit":
            break
        if line == "/reset":
            history.clear()
            conversation = history_db.new_conversation(args.target, setup.decoder.drafter.name)
            print("(new conversation)")
            continue
        if line == "/stats":
            print(last_stats.summary() if last_stats else "(no answer yet)")
            continue
        try:
            prompt_ids, privacy = _encode(setup, args, _messages(args, history + [{"role": "user", "content": line}]))
        except ValueError as err:
            print(f"({err})")
            continue
        history.append({"role": "user", "content": line})
        history_db.add_message(conversation, "user", line)
        answer = history_db.add_message(conversation, "assistant", "", complete=False)
        stream, writer = TextStream(setup.tokenizer), history_db.answer_writer(answer)
        print("bot> ", end="", flush=True)
        gen = setup.decoder.generate(prompt_ids, args.max_new_tokens, setup.sampling, privacy=privacy,
                                     on_event=lambda e: (writer(e), stream(e)))
        text = setup.tokenizer.decode(gen.tokens, skip_special_tokens=True)
        history_db.finish(answer, text)
        history.append({"role": "assistant", "content": text})
        last_stats = gen.stats
        print()
    history_db.close()
    setup.decoder.verifier.close()


def _quiet_libraries() -> None:
    import os
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
