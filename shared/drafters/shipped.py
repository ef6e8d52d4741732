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
    """client/checkpoints/<target alias or name> (slashes become --); a local path is named by its
    resolved form, so one folder written two ways (`x/`, `./x`, relative or absolute) maps to one name.

    Raises:
        ValueError: a name that would not give a folder directly inside client/checkpoints.
    """
    source = ModelSpec.parse(target).source
    if Path(source).exists():
        source = str(Path(source).resolve())
    name = source.replace("/", "--")
    if name in ("", ".", ".."):
        raise ValueError(f"target {target!r} names no folder of its own under {CHECKPOINTS}")
    return CHECKPOINTS / name


def default_checkpoint(target: str, kind: str, tli: int = 0) -> Path:
    """client/checkpoints/<target alias or name>/<moa-tliN | eagle2 | falcon | tokenswift>."""
    return target_folder(target) / (f"moa-tli{tli}" if kind == "moa" else kind)


def has_shipped_checkpoint(target: str | None, kind: str = "moa") -> bool:
    """Whether a `kind` checkpoint ships for `target` and fits it: for `MODEL@layers=N`, one trained
    for an N-layer target (read from its drafter.json; the full model's does not fit).

    Raises:
        ValueError: that drafter.json is damaged (checkpoint.read_config).
    """
    if target is None:
        return False
    folder = default_checkpoint(target, kind)
    if not (folder / "drafter.json").exists():
        return False
    layers = ModelSpec.parse(target).layers
    if layers is None:
        return True
    from .checkpoint import read_config  # torch and the drafter modules: only when a depth is asked

    return read_config(folder)[1].num_layers == layers
