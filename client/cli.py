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
                   help="serve behind an emulated link (relay backend): lan, wifi, 5g, 4g, offline or a .toml file")
    p.add_argument("--lsa", action="append", default=[], metavar="DRAFTER",
                   help="host this MoA drafter's LSA for clients with --lsa-placement server: moa[:tli=N|:PATH]")
    p.set_defaults(func=cmd_serve)

    for name, helptext in (("generate", "generate one answer"), ("chat", "multi-turn terminal chat")):
        p = sub.add_parser(name, help=helptext)
        _add_client_args(p)
        if name == "generate":
            p.add_argument("--prompt", required=True)
            p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
            p.set_defaults(func=cmd_generate)
        else:
            p.set_defaults(func=cmd_chat)

    from .bench import add_bench_parser
    from .demo import add_demo_parser

    add_bench_parser(sub)
    add_demo_parser(sub)
    _add_train_parser(sub)
    return parser


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
    p.add_argument("--timeout", type=float, default=60.0, help="deadline of each server call, s")
    p.add_argument("--connect-timeout", type=float, default=10.0, help="wait for the server, s")
    _add_device_args(p)


def cmd_pull(args) -> None:
    from splitspec.shared.models import pull

    print(f"{args.model}: {pull(args.model)}")


def cmd_serve(args) -> None:
    from splitspec.server.runner import TargetRunner
    from splitspec.server.service import serve
    from splitspec.shared.models import load_model

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
                          max_context=args.max_context, session_idle_ttl_s=args.session_ttl)
    runner = TargetRunner(model, tokenizer, model_id, lsa_modules)
    if args.link is None:
        asyncio.run(serve(runner, args.host, args.port, limits))
        return
    from splitspec.netsim import RelayLink, load_profile

    profile = load_profile(args.link)

    async def behind_link():
        # the service listens on a private loopback port; clients reach it only through the link
        bound = asyncio.get_running_loop().create_future()
        service = asyncio.create_task(serve(runner, "127.0.0.1", 0, limits, on_bound=bound.set_result))
        link = RelayLink(profile, ("127.0.0.1", await bound), (args.host, args.port))
        await link.start()
        print(f"emulated link {profile.name} (relay backend, seed {profile.seed}): clients connect to "
              f"{args.host}:{link.port}", flush=True)
        try:
            await service
        finally:
            await link.stop()

    asyncio.run(behind_link())


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
    from .loop import SpeculativeDecoder

    if args.local:
        from splitspec.server.runner import TargetRunner

        from .verifier import LocalVerifier

        model, tokenizer, model_id = load_model(args.target, device=args.device, dtype=args.dtype)
        verifier = LocalVerifier(TargetRunner(model, tokenizer, model_id))
        mode = "single-device"
    else:
        from .transport import RemoteVerifier

        tokenizer = load_tokenizer(args.target)
        verifier = RemoteVerifier(args.server, args.timeout, args.connect_timeout)
        mode = f"split via {args.server}"
        if tokenizer_fingerprint(tokenizer) != verifier.info.tokenizer_fingerprint:
            raise ValueError(f"the tokenizer of {args.target} differs from the server's target "
                             f"{verifier.info.model_id}; pass --target naming the server's model")
    tree = TreeConfig(depth=args.tree_depth, top_b=args.tree_top_b, max_nodes=args.tree_nodes)
    drafter = make_drafter("none" if args.no_spec else args.drafter,
                           target_fingerprint=verifier.info.tokenizer_fingerprint, tree=tree,
                           device=args.device, dtype=args.dtype, seed=args.seed, target=args.target,
                           target_model=verifier.runner.model if args.local else None,
                           lsa_placement=args.lsa_placement, quantization=FEATURE_QUANT[args.feature_quant])
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    return ClientSetup(SpeculativeDecoder(verifier, drafter), tokenizer, sampling, mode)


class TextStream:
    """Prints decoded text as token ids arrive (decoding the whole answer keeps multi-byte
    characters intact)."""

    def __init__(self, tokenizer, out=sys.stdout) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete character: wait for its next byte
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)


def _messages(args, history: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": args.system}] if args.system else []) + history


def cmd_generate(args) -> None:
    from splitspec.shared.models import encode_chat

    setup = build_client(args)
    prompt_ids = encode_chat(setup.tokenizer, _messages(args, [{"role": "user", "content": args.prompt}]))
    stream = None if args.json else TextStream(setup.tokenizer)
    gen = setup.decoder.generate(prompt_ids, args.max_new_tokens, setup.sampling, on_tokens=stream)
    text = setup.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"mode": setup.mode, "drafter": setup.decoder.drafter.name, "prompt_tokens": len(prompt_ids),
                          "token_ids": gen.tokens, "text": text, "stopped_by_eos": gen.stopped_by_eos,
                          "stats": gen.stats.as_dict(), "calls": [asdict(c) for c in gen.stats.calls]}))
    else:
        print(f"\n{gen.stats.summary()}")
    setup.decoder.verifier.close()


def cmd_chat(args) -> None:
    from splitspec.shared.models import encode_chat

    setup = build_client(args)
    print(f"splitspec chat ({setup.mode}, drafter {setup.decoder.drafter.name}). /reset /stats /quit")
    history: list[dict[str, str]] = []
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
            print("(conversation cleared)")
            continue
        if line == "/stats":
            print(last_stats.summary() if last_stats else "(no answer yet)")
            continue
        history.append({"role": "user", "content": line})
        prompt_ids = encode_chat(setup.tokenizer, _messages(args, history))
        print("bot> ", end="", flush=True)
        gen = setup.decoder.generate(prompt_ids, args.max_new_tokens, setup.sampling,
                                     on_tokens=TextStream(setup.tokenizer))
        history.append({"role": "assistant", "content": setup.tokenizer.decode(gen.tokens, skip_special_tokens=True)})
        last_stats = gen.stats
        print()
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
