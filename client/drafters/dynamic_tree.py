"""EAGLE-2 dynamic draft trees (Li et al. 2024, "EAGLE-2", §4.1-4.2), for any drafter with logits.

Expansion: the root's top-B children form depth 1. At each further depth the B frontier nodes with
the highest joint probability (product of drafter probabilities along the path) are expanded into
their top-B children each. Reranking: of all nodes created, the `max_nodes` with the highest joint
probability are verified. A child's joint probability never exceeds its parent's, so the kept set
is a tree.

Sampling (temperature > 0): children are drawn without replacement from the drafter's warped
distribution (Gumbel-top-B, Kool et al. 2019), and the rows they were drawn from travel as draft
probabilities so the server's recursive rejection stays lossless (shared/acceptance.py). For that
a node may be kept or dropped on anything but its own drawn token and what was drawn after it (its
subtree, its later siblings and theirs): the ratio p/q at the server assumes the node's token is
distributed as q given that it is tried. So a sampled node's score is not the probability of the
token it drew but that of its slot: the parent's score plus the log of the i-th largest
probability of the row the i-th child was drawn from, known before the draw. Scores then fall
along the drawing order and down the tree (ties go to the earlier node), so every kept sibling set
is a prefix of its drawing order and no node is outranked by a node drawn after it. Scoring the
drawn tokens instead (as greedy does) biases the accepted tokens once reranking prunes: with the
default 2x2x4 tree an exact enumeration gave total variation 0.009 from the target's two-token
distribution, 0 with slot scores (tests/test_dynamic_tree.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from splitspec.shared.acceptance import SparseProbs
from splitspec.shared.config import TreeConfig
from splitspec.shared.sampling import SamplingParams, warp_probs
from splitspec.shared.tree import ROOT, DraftTree

from .base import DraftLimits, Proposal


@dataclass
class _Node:
    token: int
    parent: int  # index into the pool, or ROOT
    depth: int
    score: float  # log joint probability (greedy); sampled: the slot's, see the module docstring


# expand(frontier) -> logits [F, V] for each frontier node (given as pool indices); the builder
# guarantees every ancestor of a frontier node was expanded before.
ExpandFn = Callable[[list[int], list[_Node]], torch.Tensor]


def build_tree(root_logits: torch.Tensor, expand: ExpandFn, config: TreeConfig, limits: DraftLimits,
               sampling: SamplingParams, generator: torch.Generator | None = None) -> Proposal:
    """Grow and rerank a dynamic tree (EAGLE-2, Li et al. 2024, §4.1 expansion and §4.2 reranking).

    Args:
        root_logits: [V] drafter logits after the pending token.
        expand: drafter callback scoring the children of frontier nodes: (frontier node indices [F],
            the node pool) -> logits [F, V].
        config, limits: the tree's depth is min(config.depth, limits.max_depth) and its node count
            min(config.max_nodes, limits.max_nodes); either below 1 gives an empty tree. Each level
            expands the top `config.top_b` frontier nodes by score into `config.top_b` children each.
        sampling: greedy takes each node's top-B children; otherwise B children are drawn without
            replacement (Gumbel-top-k, Kool et al. 2019) and each row of `draft_probs` is a
            SparseProbs [S] with S <= `limits.max_support`.
        generator: the drafter's random stream (`Stream.DRAFTER`); unused when greedy.
    Returns:
        The proposal; `draft_probs` has a row for the root and each kept node with kept children
        when sampling, and is empty when greedy.
    """
    depth_limit = min(config.depth, limits.max_depth)
    max_nodes = min(config.max_nodes, limits.max_nodes)
    if depth_limit < 1 or max_nodes < 1:
        return Proposal(DraftTree.empty())
    pool: list[_Node] = []
    rows: dict[int, SparseProbs] = {}
    frontier = _add_children(pool, rows, ROOT, 0.0, 1, root_logits, config.top_b, sampling, generator,
                             limits.max_support)
    for depth in range(2, depth_limit + 1):
        frontier = sorted(frontier, key=lambda i: (-pool[i].score, i))[: config.top_b]
        if not frontier:
            break
        logits = expand(frontier, pool)  # [F, V]
        created = []
        for node, node_logits in zip(frontier, logits):
            created += _add_children(pool, rows, node, pool[node].score, depth, node_logits, config.top_b,
                                     sampling, generator, limits.max_support)
        frontier = created
    return _rerank(pool, rows, max_nodes, sampling)


def frontier_mask(frontier: list[int], pool: list[_Node], slots: dict[int, int], base_len: int, cache_len: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, F, cache_len + F] for appending the frontier nodes to a drafter cache.

    Each row sees the first `base_len` cache slots (the committed context), the slots of its
    ancestors (expanded earlier, so already cached) and itself. Records each node's new slot in
    `slots` (pool index -> cache position).
    """
    mask = torch.full((len(frontier), cache_len + len(frontier)), torch.finfo(dtype).min, dtype=dtype)
    mask[:, :base_len] = 0
    for row, node in enumerate(frontier):
        ancestor = pool[node].parent
        while ancestor != ROOT:
            mask[row, slots[ancestor]] = 0
            ancestor = pool[ancestor].parent
        mask[row, cache_len + row] = 0
        slots[node] = cache_len + row
    return mask[None, None]


def _add_children(pool, rows, parent, parent_score, depth, logits, top_b, sampling, generator, max_support):
    """Append up to `top_b` children of `parent`; returns their pool indices."""
    if sampling.greedy:
        logprobs = torch.log_softmax(logits.float(), -1)
        values, tokens = torch.topk(logprobs, top_b)
        scores = (parent_score + values).tolist()
    else:
        probs = warp_probs(logits, sampling)
        support = min(max_support, int((probs > 0).sum()))
        row_probs, row_ids = torch.topk(probs, support)
        row_probs = row_probs / row_probs.sum()
        rows[parent] = SparseProbs(row_ids, row_probs)
        gumbel = -torch.log(-torch.log(torch.rand(support, generator=generator).clamp_min(1e-20)))
        order = torch.argsort(row_probs.log() + gumbel, descending=True)[: min(top_b, support)]
        tokens = row_ids[order]
        # the i-th drawn child's slot score: the row's i-th largest probability (topk sorted it),
        # which does not depend on the token drawn (module docstring)
        scores = (parent_score + row_probs[: len(order)].log()).tolist()
    start = len(pool)
    for token, score in zip(tokens.tolist(), scores):
        pool.append(_Node(int(token), parent, depth, float(score)))
    return list(range(start, len(pool)))


def _rerank(pool: list[_Node], rows: dict[int, SparseProbs], max_nodes: int, sampling: SamplingParams) -> Proposal:
    keep = sorted(sorted(range(len(pool)), key=lambda i: (-pool[i].score, i))[:max_nodes])
    new_index = {old: new for new, old in enumerate(keep)}
    tokens = tuple(pool[i].token for i in keep)
    parents = tuple(ROOT if pool[i].parent == ROOT else new_index[pool[i].parent] for i in keep)
    tree = DraftTree(tokens, parents)
    if sampling.greedy:
        return Proposal(tree)
    with_children = {ROOT} | {p for p in parents if p != ROOT}
    draft_probs = {}
    for old, row in rows.items():
        new = ROOT if old == ROOT else new_index.get(old)
        if new is not None and new in with_children:
            draft_probs[new] = row
    return Proposal(tree, draft_probs)
