"""Drafters and the factory that builds one from its command-line name.

Names: `auto` (the MoA checkpoint shipped for the target, else `ngram`), `none` (no drafting:
one target call per token, the autoregressive baseline), `ngram` (prompt lookup),
`draft-model:MODEL[@layers=N]` (an independent or early-exit causal LM), `moa[:tli=N | :PATH]`
(Mixture of Attentions, seed 001) and `eagle2[:PATH]` (EAGLE-2 baseline);
without a PATH the checkpoint shipped for the target is used (client/checkpoints/<target>/).
moa and eagle2 draft among the target's `draft_vocab` most frequent tokens (FR-Spec; counts in
client/checkpoints/<target>/token_counts.safetensors, see shared/drafters/draft_vocab.py).
"""
from __future__ import annotations

from pathlib import Path

from splitspec.shared.config import TreeConfig
from splitspec.shared.models import ModelSpec, load_model, tokenizer_fingerprint
from splitspec.shared.tree import DraftTree
from splitspec.v1 import verify_pb2 as pb

from .base import DraftLimits, Drafter, Proposal
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter

__all__ = ["DraftLimits", "Drafter", "Proposal", "NoDrafter", "NgramDrafter", "DraftModelDrafter",
           "make_drafter", "TokenizerMismatch"]


class TokenizerMismatch(ValueError):
    """The drafter tokenizes differently from the target: its drafts would be meaningless."""


class NoDrafter(Drafter):
    """Proposes nothing: every target call yields exactly one token (autoregressive baseline)."""

    name = "none"

    def reset(self, prompt_ids, features) -> None:
        pass

    def propose(self, context, limits, sampling) -> Proposal:
        return Proposal(DraftTree.empty())


CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
# -1: the default size when the target has token counts, else the full vocabulary; 0: full
DEFAULT_DRAFT_VOCAB = 8192


def target_folder(target: str) -> Path:
    """client/checkpoints/<target alias or name> (slashes become --)."""
    return CHECKPOINTS / ModelSpec.parse(target).source.replace("/", "--")


def default_checkpoint(target: str, kind: str, tli: int = 0) -> Path:
    """client/checkpoints/<target alias or name>/<moa-tliN | eagle2>."""
    return target_folder(target) / (f"moa-tli{tli}" if kind == "moa" else kind)


def has_shipped_checkpoint(target: str | None, kind: str = "moa") -> bool:
    return target is not None and (default_checkpoint(target, kind) / "drafter.json").exists()


def checkpoint_path(name: str, target: str) -> Path:
    """The checkpoint directory a `moa[:tli=N|:PATH]` or `eagle2[:PATH]` name refers to."""
    kind, _, arg = name.partition(":")
    if kind not in ("moa", "eagle2"):
        raise ValueError(f"{name!r} is not a moa or eagle2 drafter")
    if arg.startswith("tli="):
        return default_checkpoint(target, kind, int(arg.removeprefix("tli=")))
    return Path(arg) if arg else default_checkpoint(target, kind)


def make_drafter(name: str, *, target_fingerprint: str, tree: TreeConfig = TreeConfig(),
                 device: str = "cpu", dtype: str = "float32", seed: int = 0, target: str | None = None,
                 target_model=None, lsa_placement: str = "client", quantization: int = pb.QUANTIZATION_NONE,
                 draft_vocab: int = -1) -> Drafter:
    """Build a drafter by name.

    Args:
        target / target_model: the target (name, and the loaded model if at hand) whose frozen
            parts the self-drafting drafters (moa, eagle2) reuse.
        lsa_placement, quantization: MoA feature options (see MoARuntime).
        draft_vocab: moa/eagle2 draft among this many most frequent tokens; 0 = the full
            vocabulary; -1 = DEFAULT_DRAFT_VOCAB when the target has shipped token counts, else full.
    Raises:
        ValueError: unknown drafter name.
        TokenizerMismatch: a drafter whose tokenizer fingerprint differs from the target's.
        FileNotFoundError: draft_vocab > 0 for a target without token counts.
        CheckpointMismatch: a checkpoint trained for another target.
    """
    if name == "auto":  # the shipped MoA drafter for this target if there is one, else prompt lookup
        name = "moa" if has_shipped_checkpoint(target) else "ngram"
    kind, _, arg = name.partition(":")
    if kind in ("moa", "eagle2"):
        return _self_drafter(kind, arg, target_fingerprint=target_fingerprint, tree=tree, seed=seed, target=target,
                             target_model=target_model, lsa_placement=lsa_placement, quantization=quantization,
                             draft_vocab=draft_vocab)
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        return NgramDrafter()
    if kind == "draft-model":
        if not arg:
            raise ValueError("draft-model needs a model: draft-model:MODEL[@layers=N]")
        model, tokenizer, model_id = load_model(arg, device=device, dtype=dtype)
        fingerprint = tokenizer_fingerprint(tokenizer)
        if fingerprint != target_fingerprint:
            raise TokenizerMismatch(f"drafter {model_id} tokenizer {fingerprint} differs from the target's "
                                    f"{target_fingerprint}")
        drafter = DraftModelDrafter(model, tree, seed=seed)
        drafter.name = f"draft-model:{arg}"
        return drafter
    raise ValueError(f"unknown drafter {name!r}; expected none, ngram, draft-model:MODEL[@layers=N], "
                     "moa[:tli=N|:PATH] or eagle2[:PATH]")


def _self_drafter(kind: str, arg: str, *, target_fingerprint, tree, seed, target, target_model, lsa_placement,
                  quantization, draft_vocab) -> Drafter:
    from splitspec.shared.drafters.checkpoint import TargetIdentity, checkpoint_id, load_checkpoint
    from splitspec.shared.drafters.target_parts import TargetParts

    from .eagle import EagleRuntime
    from .moa import MoARuntime

    if target is None:
        raise ValueError(f"{kind} needs the target model (--target) for its embedding and LM head")
    path = checkpoint_path(f"{kind}:{arg}", target)
    if target_model is None:
        target_model, tokenizer, model_id = load_model(target)
    else:
        from splitspec.shared.models import load_tokenizer

        tokenizer, model_id = load_tokenizer(target), target
    identity = TargetIdentity.of(target_model, tokenizer, model_id)
    if identity.tokenizer_fingerprint != target_fingerprint:
        raise TokenizerMismatch(f"{target} tokenizes differently from the server's target")
    dtype = target_model.get_output_embeddings().weight.dtype
    _, module, meta = load_checkpoint(path, identity, dtype=dtype)
    if meta["kind"] != kind:
        raise ValueError(f"{path} holds a {meta['kind']} drafter, not {kind}")
    parts = TargetParts(target_model, module.config.tli if kind == "moa" else 0)
    parts.restrict_vocab(_draft_vocab_ids(target, draft_vocab, target_fingerprint))
    if kind == "eagle2":
        return EagleRuntime(module, parts, tree, quantization=quantization, seed=seed)
    lsa_id = checkpoint_id(path) if lsa_placement == "server" else ""
    return MoARuntime(module, parts, tree, lsa_placement=lsa_placement, lsa_id=lsa_id, quantization=quantization,
                      seed=seed)


def _draft_vocab_ids(target: str, size: int, fingerprint: str):
    """Token ids [N] for TargetParts.restrict_vocab, or None for the full vocabulary."""
    from splitspec.shared.drafters.draft_vocab import COUNTS, load_draft_vocab

    counts = target_folder(target) / COUNTS
    if size == 0 or (size < 0 and not counts.exists()):
        return None
    if not counts.exists():
        raise FileNotFoundError(f"no token counts for {target} ({counts}); make them with `splitspec draft-vocab` "
                                "or pass --draft-vocab 0")
    return load_draft_vocab(counts, DEFAULT_DRAFT_VOCAB if size < 0 else size, fingerprint)
