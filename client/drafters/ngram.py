"""Prompt-lookup drafting (training-free): continue the context the way it continued before.

Find the most recent earlier occurrences of the context's last n tokens (n from `max_ngram` down
to `min_ngram`) and propose the tokens that followed them (Saxena 2023, "Prompt Lookup Decoding";
transformers' `PromptLookupCandidateGenerator`). Up to `branches` distinct continuations are merged
into a trie, so one verification checks several guesses. Proposals are deterministic (one-hot),
which keeps sampling lossless without sending draft probabilities.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import DraftTree

from .base import DraftLimits, Drafter, Proposal


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, depth: int = 8, branches: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram, self.depth, self.branches = max_ngram, min_ngram, depth, branches

    def reset(self, prompt_ids, features) -> None:
        pass

    def propose(self, context: Sequence[int], limits: DraftLimits, sampling: SamplingParams) -> Proposal:
        depth = min(self.depth, limits.max_depth)
        if depth < 1:
            return Proposal(DraftTree.empty())
        continuations = self._continuations(np.asarray(context), depth)
        return Proposal(_trie(continuations, limits.max_nodes))

    def _continuations(self, ctx: np.ndarray, depth: int) -> list[list[int]]:
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            pattern = ctx[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
            starts = np.flatnonzero((windows == pattern).all(axis=1))[::-1]  # most recent first
            for s in starts:
                cont = ctx[s + n: s + n + depth].tolist()
                if cont and cont not in found:
                    found.append(cont)
                if len(found) == self.branches:
                    return found
        return found


def _trie(continuations: list[list[int]], max_nodes: int) -> DraftTree:
    """Merge token sequences into a tree (shared prefixes once), earlier sequences first."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for seq in continuations:
        parent = -1
        for tok in seq:
            node = index.get((parent, tok))
            if node is None:
                if len(tokens) == max_nodes:
                    break
                node = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                index[(parent, tok)] = node
            parent = node
    return DraftTree(tuple(tokens), tuple(parents))
