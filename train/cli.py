"""The training commands: `splitspec train` and `splitspec draft-vocab`.

`add_train_parsers` adds them to the top-level parser (cli/main.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from splitspec.shared.drafters.draft_vocab import COUNTS
from splitspec.shared.drafters.shipped import target_folder
from splitspec.shared.models import DEFAULT_TARGET


def add_train_parsers(sub) -> None:
    """train and draft-vocab."""
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

    p = sub.add_parser("draft-vocab", help="count the target's tokens in ShareGPT responses for the draft vocabulary")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--data", default="sharegpt", choices=["sharegpt"])
    p.add_argument("--max-len", type=int, default=2048, help="tokens counted per conversation")
    p.add_argument("--limit", type=int, default=None, help="count only this many training conversations")
    p.add_argument("--out", default=None, help="default: client/checkpoints/<target>/token_counts.safetensors")
    p.set_defaults(func=cmd_draft_vocab)


def cmd_train(args) -> None:
    from .trainer import TrainConfig, train  # the training stack loads when the command runs

    cfg = TrainConfig(drafter=args.drafter, target=args.target, out=Path(args.out), tli=args.tli,
                      max_tokens=args.max_tokens, epochs=args.epochs, max_len=args.max_len, batch=args.batch,
                      lr=args.lr, eval_every=args.eval_every, seed=args.seed, device=args.device, resume=args.resume)
    print(json.dumps(train(cfg)))


def cmd_draft_vocab(args) -> None:
    from .vocab import make_counts  # the training data stack loads when the command runs

    out = Path(args.out) if args.out else target_folder(args.target) / COUNTS
    result = make_counts(args.target, out, max_len=args.max_len, limit=args.limit)
    print(json.dumps({"out": str(out), **result}))
