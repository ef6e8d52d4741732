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
from splitspec.shared.tree import ROOT, DraftTree

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
        continuations = self.continuations(np.asarray(context), depth)
        return Proposal(merge_chains(DraftTree.empty(), continuations, limits.max_nodes))

    def continuations(self, ctx: np.ndarray, depth: int) -> list[list[int]]:
        """Up to `branches` distinct continuations of up to `depth` tokens, most recent match first."""
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


def merge_chains(tree: DraftTree, chains: list[Sequence[int]], max_nodes: int,
                 closed: frozenset[int] = frozenset()) -> DraftTree:
    """`tree` with each chain added from the root, sharing the nodes it already has (and earlier
    chains' nodes), within `max_nodes` in all. Existing nodes keep their indices, so a proposal's
    draft-probability rows stay valid; a chain that reaches the limit is cut there, and so is one
    that would add a child under a node in `closed` (-1 = the root)."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    child = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents))}
    for chain in chains:
        parent = ROOT
        for token in chain:
            token = int(token)
            if (parent, token) not in child:
                if len(tokens) >= max_nodes or parent in closed:
                    break
                child[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = child[(parent, token)]
    return DraftTree(tuple(tokens), tuple(parents))


class PromptLookupMerge(Drafter):
    """Another drafter's tree with a prompt-lookup chain merged in.

    The chain is what `NgramDrafter` would propose (the tokens that followed the most recent earlier
    occurrence of the context's last 3, else 2, else 1 tokens: transformers' prompt lookup also goes
    down to one), at most `depth` tokens. It joins the inner drafter's tree from the root, sharing
    the nodes the two agree on, so it costs verify rows only where it goes beyond the drafter's own
    guesses. Text that repeats itself or copies from the prompt (summaries, extraction, answers
    quoting a document, code) gets long accepted runs the drafter alone would not draft. Drafting by
    retrieval is REST's (He et al. 2024); joining a retrieved draft to a model drafter's tree is
    SAM-Decoding's (Hu et al. 2024, with EAGLE-2); TokenSwift (seed 003 §2.2) merges its n-gram
    chains into its heads' tree the same way.

    Under sampling a node's children are judged against the draft-probability row they were drawn
    from, or as one-hot proposals where the node has no row (shared/acceptance.py), so the chain
    only follows the drafter's nodes and grows below the first one without a row (a leaf): it
    never adds a sibling to children the drafter sampled, which keeps sampling lossless. Everything
    else (features wanted, commits, rollbacks, the tree the planner sets) is the inner drafter's.
    """

    def __init__(self, inner: Drafter, depth: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"a prompt-lookup chain needs depth >= 1, got {depth}")
        self.__dict__["inner"] = inner  # before any attribute write reaches __setattr__
        self.lookup = NgramDrafter(max_ngram, min_ngram, depth=depth)
        self.name = f"{inner.name}+lookup{depth}"
        self.feature_request = inner.feature_request
        self.stats = {"lookup_steps": 0, "lookup_nodes": 0, "lookup_accepted": 0}
        self._added: set[tuple[int, ...]] = set()  # root-to-node token paths of the nodes the chain added

    def __getattr__(self, key):  # anything else (e.g. the tree a planner reads) is the inner drafter's
        return getattr(self.__dict__["inner"], key)

    def __setattr__(self, key, value) -> None:
        if key == "tree":  # the network-aware planner sets each step's tree on the drafter
            setattr(self.inner, key, value)
        else:
            super().__setattr__(key, value)

    def reset(self, prompt_ids, features) -> None:
        self._added = set()
        self.inner.reset(prompt_ids, features)

    def propose(self, context: Sequence[int], limits: DraftLimits, sampling: SamplingParams) -> Proposal:
        proposal = self.inner.propose(context, limits, sampling)
        self._added = set()
        depth = min(self.lookup.depth, limits.max_depth)
        chains = self.lookup.continuations(np.asarray(context), depth) if depth >= 1 else []
        if not chains:
            return proposal
        closed = frozenset() if sampling.greedy else frozenset(proposal.draft_probs)  # nodes with sampled children
        tree = merge_chains(proposal.tree, chains, limits.max_nodes, closed)
        if tree.size > proposal.tree.size:
            self.stats["lookup_steps"] += 1
            self.stats["lookup_nodes"] += tree.size - proposal.tree.size
            self._added = set(_paths(tree)[proposal.tree.size:])
        return Proposal(tree, proposal.draft_probs, drafted=proposal.tree.size)

    def commit(self, new_tokens, features) -> None:
        if self._added:  # accepted tokens the chain drafted and the inner drafter did not
            accepted = tuple(new_tokens)[:-1]  # the last one is the bonus token
            self.stats["lookup_accepted"] += sum(accepted[:n] in self._added for n in range(1, len(accepted) + 1))
            self._added = set()
        self.inner.commit(new_tokens, features)

    def reseed(self, seed: int) -> None:
        self.inner.reseed(seed)

    def rollback(self, length: int) -> None:
        self._added = set()
        self.inner.rollback(length)

    def report(self) -> dict:
        return {**self.inner.report(), **self.stats}


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """The token path from the root to each node, [N]."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append((paths[parent] if parent != ROOT else ()) + (token,))
    return paths
