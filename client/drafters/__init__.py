"""Drafters: each implements the `Drafter` interface of base.py.

`none` (no drafting: one target call per token, the autoregressive baseline), `ngram` (prompt
lookup), `draft-model:MODEL[@layers=N]` (an independent or early-exit causal LM), `moa` (Mixture of
Attentions, seed 001, moa.py) and `eagle2` (EAGLE-2 baseline, eagle.py). factory.py builds one
from its `DrafterSpec` (shared/drafters/spec.py); it loads the self-drafting architectures, so it
is imported where a drafter is built.
"""
from __future__ import annotations

from .base import DraftLimits, Drafter, NoDrafter, Proposal
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter

__all__ = ["DraftLimits", "Drafter", "Proposal", "NoDrafter", "NgramDrafter", "DraftModelDrafter"]
