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


class Growing:
    """A tensor that grows along `dim` as parts are appended, in amortised O(part) per append: a
    buffer that doubles when full. A torch.cat of the whole history at every commit made a long
    answer's commits O(n^2) in copying (fp32 [n, 576] features: ~21 ms a commit at 16K positions).
    EAGLE-2, Falcon and TokenSwift keep the target features so (rows no attention reads: the cat
    was pure copying). MoA's memory K/V stay concatenated: attention reads them whole at every
    drafting forward anyway, and a view of a doubling buffer is strided along the heads.

    `empty`: a tensor with size 0 along `dim`, giving the other sizes and the dtype. `len()` is the
    size along `dim`; `.tensor` (and indexing, `g[i]`, `g[a:b]`, along dim 0) views the filled part,
    valid until the next append."""

    def __init__(self, empty: torch.Tensor, dim: int = 0) -> None:
        assert empty.shape[dim] == 0, empty.shape
        self._buffer, self._dim, self._count = empty, dim, 0

    def append(self, part: torch.Tensor) -> None:
        """Add `part` (same sizes but along `dim`; cast to the buffer's dtype)."""
        end = self._count + part.shape[self._dim]
        if end > self._buffer.shape[self._dim]:
            shape = list(self._buffer.shape)
            shape[self._dim] = max(end, 2 * shape[self._dim], 256)
            grown = self._buffer.new_empty(shape)
            grown.narrow(self._dim, 0, self._count).copy_(self.tensor)
            self._buffer = grown
        self._buffer.narrow(self._dim, self._count, end - self._count).copy_(part)
        self._count = end

    @property
    def tensor(self) -> torch.Tensor:
        return self._buffer.narrow(self._dim, 0, self._count)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        return self.tensor[index]
