"""The drafter interface: all a drafter implements to take part in the speculative loop.

A drafter sees the committed context (prompt + generated tokens, the last one being the pending
token) and the target features the server returned for committed positions, and proposes a draft
tree. Later drafters (MoA, EAGLE-2, SWIFT, TokenSwift, Falcon) only implement this.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import torch

from splitspec.shared.acceptance import SparseProbs
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.shared.sampling import SamplingParams, Stream, make_generator
from splitspec.shared.tree import DraftTree


@dataclass(frozen=True)
class Proposal:
    """A draft tree, plus the proposal rows it was sampled from (sampling only; empty when the
    children were chosen deterministically, see DraftProbs in verify.proto)."""

    tree: DraftTree
    draft_probs: dict[int, SparseProbs] = field(default_factory=dict)
    drafted: int | None = None  # nodes 0 .. drafted-1 are the drafter's; later ones a lookup chain's (None: all)


@dataclass(frozen=True)
class DraftLimits:
    """Bounds for one proposal: tree depth (remaining token budget) and node count (server limit)."""

    max_depth: int
    max_nodes: int
    max_support: int = 256  # entries per draft-probability row


class Drafter(ABC):
    """Proposes draft trees. One instance drafts one sequence at a time."""

    name: str = "drafter"
    #: the target features this drafter needs from the server
    feature_request: FeatureRequest = FeatureRequest()

    @abstractmethod
    def reset(self, prompt_ids: Sequence[int], features: FeatureBatch) -> None:
        """Start a new sequence: `prompt_ids` [P] are committed; `features` cover positions [0, P)."""

    @abstractmethod
    def propose(self, context: Sequence[int], limits: DraftLimits, sampling: SamplingParams) -> Proposal:
        """Draft after `context` (all committed tokens; its last is the pending token). Tokens after
        the last position with features (offline or privately produced text) must be handled too.

        Raises:
            RuntimeError: (drafters that read features) more positions verified than `context` holds
                before its pending token: the loop and the drafter disagree.
        """

    def commit(self, new_tokens: Sequence[int], features: FeatureBatch) -> None:
        """Tokens were committed (accepted + bonus); `features` cover the newly cached positions.

        Raises:
            ValueError: (drafters that read features) the features do not start where the drafter's
                verified positions end (`check_contiguous`).
        """

    def reseed(self, seed: int) -> None:
        """Restart the drafter's random stream (`Stream.DRAFTER`, shared/sampling.py) from the user's
        `seed`: the loop calls it at the start of every answer, so that a sampled answer's drafts, and
        with them the target's draws, depend on its seed alone, not on the answers drawn before it.
        Drafters that keep no `generator` have nothing to restart."""
        if "generator" in vars(self):
            self.generator = make_generator(seed, Stream.DRAFTER)

    def report(self) -> dict:
        """What the drafter adapted while it ran (JSON-serialisable; SWIFT: its skip-set search),
        for benchmarks to record. Empty by default."""
        return {}

    def rollback(self, length: int) -> None:
        """The committed context was cut back to its first `length` tokens (offline text healed by the
        target); drop any state for later positions. Features never cover positions >= `length - 1`
        when this is called."""


class NoDrafter(Drafter):
    """Proposes nothing: every target call yields exactly one token (autoregressive baseline)."""

    name = "none"

    def reset(self, prompt_ids, features) -> None:
        pass

    def propose(self, context, limits, sampling) -> Proposal:
        return Proposal(DraftTree.empty())


def check_contiguous(features: FeatureBatch, verified: int) -> None:
    """Features must continue where the drafter's verified positions end.

    Raises:
        ValueError: they start elsewhere (a gap or an overlap: the loop and the drafter disagree).
    """
    if features.start != verified:
        raise ValueError(f"features start at {features.start}; {verified} positions are verified")


class FeatureRows:
    """The target features of the verified positions, [n, E] rows appended as steps commit, in
    amortised O(rows added) per commit: a buffer that doubles when full (a torch.cat of the whole
    history at every commit made a long answer's commits O(n^2): ~0.1 s a step at 32K positions).
    `len(rows)` is n; `rows[i]` / `rows[a:b]` index the filled rows (views: valid until the next append)."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        self._buffer = torch.zeros(0, width, dtype=dtype)
        self._count = 0

    def append(self, rows: torch.Tensor) -> None:
        """Add rows [k, E] (cast to the buffer's dtype)."""
        end = self._count + rows.shape[0]
        if end > self._buffer.shape[0]:
            grown = torch.empty(max(end, 2 * self._buffer.shape[0], 256), self._buffer.shape[1],
                                dtype=self._buffer.dtype)
            grown[:self._count] = self._buffer[:self._count]
            self._buffer = grown
        self._buffer[self._count:end] = rows
        self._count = end

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        return self._buffer[:self._count][index]
