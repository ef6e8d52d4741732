"""The `splitspec` command: the composition root that wires each room's subcommands.

    client  generate, chat              (client/cli.py)
            up                          (client/daemon/cli.py)
    server  serve                       (server/cli.py)
    train   train, train-bench, distill-data, draft-vocab, train-curve   (train/cli.py)
    netsim  netsim                      (netsim/cli.py)
    bench   bench, offline-eval, demo, serve-bench, prefill-bench, verify-cost, long-bench   (bench/cli.py)
    here    pull

Only this module imports across rooms to hand one room's parts to another: the in-process
verifier (server) to the client's --local, and the emulated link (netsim) to serve's --link.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

import grpc

from splitspec.bench.cli import add_bench_parsers
from splitspec.client.cli import add_client_parsers
from splitspec.client.daemon.cli import add_daemon_parser
from splitspec.netsim.cli import add_netsim_parser, serve_behind_link
from splitspec.server.cli import add_server_parsers
from splitspec.shared.models import DEFAULT_TARGET, ModelSpec, pull
from splitspec.train.cli import add_train_parsers


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (2: a usage or runtime error, 3: the verify
    service refused a call, 130: interrupted)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:  # a command that keeps partial results has said where, above
        print("splitspec: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as err:
        print(f"splitspec: error: {err}", file=sys.stderr)
        return 2
    except grpc.RpcError as err:
        print(f"splitspec: error: the verify service answered {err.code().name}: {err.details()}", file=sys.stderr)
        return 3


DESCRIPTION = ("Split speculative decoding: a drafter on this device proposes draft trees, a target model behind a gRPC\n"
               "verify service checks each in one forward pass; the answer is exactly the target's. `splitspec demo`\n"
               "runs both ends here; README.md has the rest.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # --version on one line
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (default: warnings only)")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pull", help="obtain a model and cache a converted copy")
    p.add_argument("model", nargs="?", default=DEFAULT_TARGET)
    p.add_argument("--force", action="store_true",
                   help="convert an alias or .gguf file again even where a converted copy is cached "
                        "(repairs a damaged copy)")
    p.set_defaults(func=cmd_pull)
    add_server_parsers(sub, behind_link=serve_behind_link)
    add_client_parsers(sub, local_verifier=load_local_verifier)
    add_daemon_parser(sub, local_verifier=load_local_verifier)
    add_bench_parsers(sub)
    add_netsim_parser(sub)
    add_train_parsers(sub)
    _show_defaults(parser)
    return parser


def _version() -> str:
    """splitspec's installed version and the libraries that decide its numbers (for bug reports)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"
    return (f"splitspec {of('splitspec')} (torch {of('torch')}, transformers {of('transformers')}, "
            f"grpcio {of('grpcio')}, Python {sys.version.split()[0]})")


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to the help of every option of `parser` and its subcommands that has a
    default worth naming (not None, False or empty) and whose help does not already name one; an
    option without help gets that as its help. (argparse.ArgumentDefaultsHelpFormatter would also
    print "default: None" and "default: False", and skips options without help.)"""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in set(action.choices.values()):
                _show_defaults(subparser)
            continue
        default, text = action.default, action.help or ""
        if (action.help == argparse.SUPPRESS or default is None or default is False or default in ("", [])
                or default == argparse.SUPPRESS or "default" in text.lower()):
            continue
        if isinstance(default, (list, tuple)):  # a parsed comma list: shown as it is typed
            if not all(isinstance(v, (int, float, str)) for v in default):
                continue  # a parsed structure ((1, 'ragged'), ...) would not read as input
            shown = ",".join(map(str, default)).replace("%", "%%")
        else:
            shown = "%(default)s"
        action.help = f"{text} (default: {shown})" if text else f"default: {shown}"


def load_local_verifier(target: str, device: str, dtype: str):
    """The client's --local verifier: server/local.py's, loaded only when a command asks for it."""
    from splitspec.server.local import load_local_verifier as load

    return load(target, device, dtype)


def cmd_pull(args) -> None:
    """Raises ValueError: an empty name, a model that cannot be pulled, or @layers=N beyond its layers."""
    if not args.model.strip():
        raise ValueError("give a model to pull: an alias, a Hugging Face id, a folder or a .gguf file")
    spec = ModelSpec.parse(args.model)
    folder = pull(spec.source, force=args.force)
    if spec.layers is not None:  # checked as loading it would (it said done, and generate then refused)
        import json

        layers = json.loads((folder / "config.json").read_text()).get("num_hidden_layers")
        if layers is not None and spec.layers > layers:
            raise ValueError(f"{args.model}: @layers={spec.layers} but the model has {layers} layers")
    print(f"{args.model}: {folder}")


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
