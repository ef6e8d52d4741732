"""Where the drafter checkpoints shipped with splitspec live: client/checkpoints/<target>/.

Per target folder: `moa-tli<N>/`, `eagle2/`, `falcon/` and `tokenswift/` (checkpoint folders,
shared/drafters/checkpoint.py) and `token_counts.safetensors` (the draft vocabulary's counts,
shared/drafters/draft_vocab.py).
They are package data of `splitspec.client`; they are found here by path, beside this package in
the installed `splitspec` tree (or the checkout), so that shared/ imports no room.
"""
from __future__ import annotations

from pathlib import Path

from splitspec.shared.models import ModelSpec

CHECKPOINTS = Path(__file__).resolve().parents[2] / "client" / "checkpoints"


def target_folder(target: str) -> Path:
    """client/checkpoints/<target alias or name> (slashes become --)."""
    return CHECKPOINTS / ModelSpec.parse(target).source.replace("/", "--")


def default_checkpoint(target: str, kind: str, tli: int = 0) -> Path:
    """client/checkpoints/<target alias or name>/<moa-tliN | eagle2 | falcon | tokenswift>."""
    return target_folder(target) / (f"moa-tli{tli}" if kind == "moa" else kind)


def has_shipped_checkpoint(target: str | None, kind: str = "moa") -> bool:
    return target is not None and (default_checkpoint(target, kind) / "drafter.json").exists()
