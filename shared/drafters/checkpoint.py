"""Drafter checkpoints: safetensors holding only the trainable weights, plus a JSON config that
names the drafter kind, its sizes and the target it was trained against (the target's embedding,
LM head, norm and TLI layers are loaded from the target itself, never stored here).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .eagle import EagleConfig, EagleDrafter
from .falcon import FalconConfig, FalconDrafter
from .tokenswift import TokenSwiftConfig, TokenSwiftHeads
from .moa import MoAConfig, MoADrafter

WEIGHTS = "model.safetensors"
CONFIG = "drafter.json"
KINDS = {"moa": (MoAConfig, MoADrafter), "eagle2": (EagleConfig, EagleDrafter), "falcon": (FalconConfig, FalconDrafter),
         "tokenswift": (TokenSwiftConfig, TokenSwiftHeads)}


class CheckpointMismatch(ValueError):
    """The checkpoint was trained for another target (different tokenizer, layers or width)."""


@dataclass(frozen=True)
class TargetIdentity:
    model_id: str
    tokenizer_fingerprint: str
    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, model, tokenizer, model_id: str) -> "TargetIdentity":
        from splitspec.shared.models import tokenizer_fingerprint

        return cls(model_id, tokenizer_fingerprint(tokenizer), model.config.num_hidden_layers,
                   model.config.hidden_size, model.get_output_embeddings().weight.shape[0])

    def check(self, other: "TargetIdentity") -> None:
        """Raise CheckpointMismatch unless `other` (the target in use) matches in everything but its id."""
        for field in ("tokenizer_fingerprint", "num_layers", "hidden_size", "vocab_size"):
            if getattr(self, field) != getattr(other, field):
                raise CheckpointMismatch(f"drafter trained for {self.model_id} ({field}={getattr(self, field)}) "
                                         f"but the target {other.model_id} has {field}={getattr(other, field)}")


def save_checkpoint(out: Path, kind: str, drafter: torch.nn.Module, target: TargetIdentity, info: dict,
                    dtype: torch.dtype = torch.bfloat16) -> None:
    """Write weights (cast to `dtype`) and config atomically into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()
               if not k.endswith("inv_freq")}
    save_tensors(tensors, out / WEIGHTS, {"kind": kind})
    config = {"kind": kind, "config": drafter.config.to_dict(), "target": target.__dict__, "training": info}
    (out / (CONFIG + ".tmp")).write_text(json.dumps(config, indent=2))
    (out / (CONFIG + ".tmp")).replace(out / CONFIG)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write `tensors` to the safetensors file `path` atomically (a temp file renamed, removed again
    when the write fails), as readable as the umask allows: safetensors 0.8 makes its files 0600, so
    a server or client running as another user could not load a trained checkpoint (QA 58)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    """This process's umask, read without changing it where Linux reports it (os.umask can only be
    read by setting it, which races with files other threads create meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def checkpoint_id(path: str | Path) -> str:
    """A content id for a checkpoint: its kind and a hash of its weights file."""
    path = Path(path)
    meta = json.loads((path / CONFIG).read_text())
    digest = hashlib.sha256((path / WEIGHTS).read_bytes()).hexdigest()[:16]
    return f"{meta['kind']}-{digest}"


def load_checkpoint(path: str | Path, target: TargetIdentity | None = None, dtype: torch.dtype = torch.float32):
    """Build the drafter module from a checkpoint directory.

    Returns:
        (kind, drafter module in eval mode, the checkpoint's config dict)
    Raises:
        FileNotFoundError: no checkpoint there, or its weights file is missing.
        CheckpointMismatch: trained for another target.
        ValueError: a damaged checkpoint, naming the file and what is wrong: drafter.json not JSON,
            missing keys, an unknown kind, a config its kind does not take; weights that are no
            safetensors file (truncated) or do not fit the config.
    """
    from safetensors import SafetensorError

    path = Path(path)
    if not (path / CONFIG).exists():
        raise FileNotFoundError(f"no drafter checkpoint in {path} ({CONFIG} missing)")
    meta, identity = read_config(path)
    if target is not None:
        identity.check(target)
    config_cls, module_cls = KINDS[meta["kind"]]
    try:
        module = module_cls(config_cls(**meta["config"]))
    except Exception as err:  # the config classes and transformers' validation of them raise assorted types
        raise _damaged(path / CONFIG, f"not a valid {meta['kind']} config: {' '.join(str(err).split())}") from err
    try:
        state = load_file(str(path / WEIGHTS))
    except SafetensorError as err:
        raise _damaged(path / WEIGHTS, f"not a valid safetensors file ({err})") from err
    try:
        missing, unexpected = module.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    except RuntimeError as err:  # tensor shapes that differ from the config's
        raise _damaged(path / WEIGHTS, f"weights do not fit the {meta['kind']} config: {err}") from err
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit {meta['kind']}: missing {missing}, unexpected {unexpected}")
    return meta["kind"], module.to(dtype).eval().requires_grad_(False), meta


def read_config(path: str | Path) -> tuple[dict, TargetIdentity]:
    """The checkpoint's drafter.json and the target identity it records, checked for what loading
    needs (valid JSON; a known `kind`; `config` and `target` objects).

    Raises:
        OSError: drafter.json cannot be read. ValueError: it is damaged (naming it and what is wrong).
    """
    file = Path(path) / CONFIG
    try:
        meta = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise _damaged(file, f"not valid JSON ({err})") from err
    if not isinstance(meta, dict) or not all(isinstance(meta.get(key), dict) for key in ("config", "target")):
        raise _damaged(file, "no `config` or `target` object")
    if meta.get("kind") not in KINDS:
        raise ValueError(f"unknown drafter kind {meta.get('kind')!r} in {path} (expected one of {', '.join(KINDS)})")
    try:
        return meta, TargetIdentity(**meta["target"])
    except TypeError as err:  # missing or unknown fields
        raise _damaged(file, f"its `target` is not a target identity ({err})") from err


def _damaged(file: Path, what: str) -> ValueError:
    return ValueError(f"drafter checkpoint {file}: {what}; the checkpoint is damaged or from another splitspec version")
