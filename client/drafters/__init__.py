"""Drafters and the factory that builds one from its command-line name.

Names: `none` (no drafting: one target call per token, the autoregressive baseline), `ngram`
(prompt lookup), `draft-model:MODEL[@layers=N]` (an independent or early-exit causal LM).
"""
from __future__ import annotations

from splitspec.shared.config import TreeConfig
from splitspec.shared.models import load_model, tokenizer_fingerprint
from splitspec.shared.tree import DraftTree

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


def make_drafter(name: str, *, target_fingerprint: str, tree: TreeConfig = TreeConfig(),
                 device: str = "cpu", dtype: str = "float32", seed: int = 0) -> Drafter:
    """Build a drafter by name.

    Raises:
        ValueError: unknown drafter name.
        TokenizerMismatch: a draft model whose tokenizer fingerprint differs from the target's.
    """
    kind, _, arg = name.partition(":")
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        return NgramDrafter(depth=tree.depth + 3)
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
    raise ValueError(f"unknown drafter {name!r}; expected none, ngram or draft-model:MODEL[@layers=N]")
