"""The EAGLE-2 dynamic tree builder's sampled path (client/drafters/dynamic_tree.py): siblings are
drawn without replacement, and a node's score is capped by its previous sibling's so that every
kept sibling set is a prefix of its drawing order, which keeps tree speculative sampling lossless."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from splitspec.client.drafters.base import DraftLimits
from splitspec.client.drafters.dynamic_tree import _add_children, build_tree
from splitspec.shared.acceptance import accept_sampling
from splitspec.shared.config import TreeConfig
from splitspec.shared.sampling import SamplingParams, warp_probs
from splitspec.shared.tree import ROOT

V = 6
SAMPLING = SamplingParams(temperature=1.0)
LIMITS = DraftLimits(max_depth=4, max_nodes=64)


def _children(tree, parent: int) -> list[int]:
    return [tree.tokens[n] for n in range(tree.size) if tree.parents[n] == parent]


def test_sibling_scores_are_capped_by_the_previous_sibling():
    """Drawn in an order other than by probability, a later sibling's score falls to its earlier
    sibling's: scores never rise along the drawing order, and none exceeds its own log probability."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    out_of_order = 0
    for seed in range(50):
        pool, rows = [], {}
        kids = _add_children(pool, rows, ROOT, 0.0, 1, logits, 3, SAMPLING, torch.Generator().manual_seed(seed), 256)
        row = dict(zip(rows[ROOT].token_ids.tolist(), rows[ROOT].probs.tolist()))
        scores = [pool[i].score for i in kids]
        own = [math.log(row[pool[i].token]) for i in kids]  # log drafter probability of each drawn child
        assert scores == sorted(scores, reverse=True)
        assert scores == pytest.approx([min(own[: i + 1]) for i in range(len(own))])
        out_of_order += own != sorted(own, reverse=True)
    assert out_of_order > 0  # some draws put a less likely sibling first: the cap was exercised


def test_kept_siblings_are_a_prefix_of_the_drawing_order():
    """Reranked down to a few nodes, the tree keeps, under each parent, the first children drawn:
    the same draws with room for every node show the full drawing order."""
    torch.manual_seed(0)
    root_logits = torch.randn(V)
    child_logits = torch.randn(V, V)

    def expand(frontier, pool):  # [F, V]: each node's children depend on its token
        return child_logits[[pool[i].token for i in frontier]]

    config = TreeConfig(depth=3, top_b=3, max_nodes=64)
    for seed in range(20):
        full = build_tree(root_logits, expand, config, LIMITS, SAMPLING, torch.Generator().manual_seed(seed))
        small = build_tree(root_logits, expand, TreeConfig(depth=3, top_b=3, max_nodes=4), LIMITS, SAMPLING,
                           torch.Generator().manual_seed(seed))
        kept = _children(small.tree, ROOT)
        assert kept == _children(full.tree, ROOT)[: len(kept)]
        assert ROOT in small.draft_probs and all(p in small.draft_probs for p in small.tree.parents if p != ROOT)


def test_sampled_trees_keep_the_target_distribution():
    """Depth-1 trees of 2 nodes kept from 3 drawn children, verified by the acceptance rule: the
    first emitted token follows the target's distribution (TV < 0.03 over 4000 trees)."""
    torch.manual_seed(1)
    draft_logits, target_logits = torch.randn(V) * 2, torch.randn(2, V) * 2
    p = warp_probs(target_logits[0], SAMPLING)
    config = TreeConfig(depth=1, top_b=3, max_nodes=2)
    gen = torch.Generator().manual_seed(2)
    counts, n = Counter(), 4000
    for _ in range(n):
        proposal = build_tree(draft_logits, None, config, LIMITS, SAMPLING, gen)
        logits = target_logits[[0] * (1 + proposal.tree.size)]  # every node sees the root's row: depth 1
        res = accept_sampling(proposal.tree, logits, SAMPLING, proposal.draft_probs, gen)
        counts[proposal.tree.tokens[res.accepted_nodes[0]] if res.accepted_nodes else res.bonus_token] += 1
    empirical = torch.tensor([counts[t] / n for t in range(V)])
    assert 0.5 * (empirical - p).abs().sum() < 0.03, (empirical, p)
