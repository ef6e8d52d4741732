"""The EAGLE-2 dynamic tree builder's sampled path (client/drafters/dynamic_tree.py): siblings are
drawn without replacement and scored by their slot, not by the token drawn, so that reranking never
keeps or drops a node for its own token and tree speculative sampling stays lossless; checked
exactly, by enumerating every draw of a small tree."""
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


def test_sampled_scores_are_the_slots_not_the_drawn_tokens():
    """A sampled child's score is its parent's plus the log of the row's i-th largest probability
    for the i-th child drawn, whatever token the draw gave it: the same for every draw, falling along
    the drawing order, though some draws put a less likely sibling first."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    ranked = torch.sort(warp_probs(logits, SAMPLING), descending=True).values
    out_of_order = 0
    for seed in range(50):
        pool, rows = [], {}
        kids = _add_children(pool, rows, ROOT, -0.25, 1, logits, 3, SAMPLING, torch.Generator().manual_seed(seed), 256)
        row = dict(zip(rows[ROOT].token_ids.tolist(), rows[ROOT].probs.tolist()))
        assert [pool[i].score for i in kids] == pytest.approx((-0.25 + ranked[:3].log()).tolist())
        own = [row[pool[i].token] for i in kids]
        out_of_order += own != sorted(own, reverse=True)
    assert out_of_order > 0  # the draws differ; the scores do not


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


# exact check: V = 4, depth 2, top-B 2; every ordered draw at the root and at each expanded node is
# enumerated with its probability, the tree is built by build_tree (its Gumbel noise forced to give
# that draw) and reranked, and the recursive rejection of shared/acceptance.py's docstring is applied
# analytically; the first two emitted tokens must follow the target's p(a) p(b | a)
_Q_ROOT = torch.tensor([0.45, 0.35, 0.15, 0.05], dtype=torch.float64)
_Q_CHILD = [torch.tensor([0.9, 0.05, 0.03, 0.02], dtype=torch.float64).roll(a) for a in range(4)]
_P_ROOT = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
_P_CHILD = [torch.softmax(torch.tensor([0.0, 0.5, 1.0, 1.5], dtype=torch.float64).roll(a), 0) for a in range(4)]


def _ordered_draws(q: torch.Tensor, k: int):
    """(tokens, probability) of every ordered draw of k distinct tokens without replacement."""
    import itertools

    for tokens in itertools.permutations(range(q.numel()), k):
        prob, left = 1.0, 1.0
        for t in tokens:
            prob, left = prob * float(q[t]) / left, left - float(q[t])
        yield tokens, prob


def _forcing_uniforms(q: torch.Tensor, tokens) -> torch.Tensor:
    """Uniforms [V] in the row's (probability-sorted) order whose Gumbel keys draw `tokens` first."""
    order = torch.topk(q.float(), q.numel()).indices.tolist()
    u = torch.full((q.numel(),), 1e-3)
    for rank, t in enumerate(tokens):
        u[order.index(t)] = 1 - 10.0 ** -(9 - 3 * rank)
    return u


def _emit(tree, node: int, p: torch.Tensor, row) -> dict:
    """{(token, child node or None): probability} at `node` under recursive rejection."""
    out, reach = {}, 1.0
    base = None if row is None else row.clone()
    for child in tree.children(node):
        x = tree.tokens[child]
        proposal = torch.nn.functional.one_hot(torch.tensor(x), p.numel()).double() if base is None else base / base.sum()
        accept = min(1.0, float(p[x] / proposal[x]))
        out[(x, child)] = out.get((x, child), 0.0) + reach * accept
        reach *= 1 - accept
        residual = (p - proposal).clamp_min(0)
        p = residual / residual.sum() if residual.sum() > 1e-12 else p
        if base is not None:
            base[x] = 0
    for t in range(p.numel()):
        out[(t, None)] = out.get((t, None), 0.0) + reach * float(p[t])
    return out


def _two_token_distribution(max_nodes: int, monkeypatch) -> dict:
    config, limits = TreeConfig(depth=2, top_b=2, max_nodes=max_nodes), DraftLimits(max_depth=2, max_nodes=64)
    forced: list[torch.Tensor] = []
    monkeypatch.setattr(torch, "rand", lambda n, generator=None: forced.pop(0))
    expanded: list[list[int]] = []

    def expand(frontier, pool):
        expanded.append([pool[i].token for i in frontier])
        return torch.stack([_Q_CHILD[pool[i].token].log().float() for i in frontier])

    def build(root_draw, child_draws):
        forced[:] = [_forcing_uniforms(_Q_ROOT, root_draw)] + [
            _forcing_uniforms(_Q_CHILD[a], draw) for a, draw in child_draws]
        return build_tree(_Q_ROOT.log().float(), expand, config, limits, SAMPLING, None)

    total: dict = {}
    for root_draw, p_root_draw in _ordered_draws(_Q_ROOT, 2):
        expanded.clear()
        build(root_draw, [(a, (0, 1)) for a in root_draw])  # learn which nodes expand, in which order
        frontier = expanded[0]
        import itertools

        for combo in itertools.product(*[list(_ordered_draws(_Q_CHILD[a], 2)) for a in frontier]):
            proposal = build(root_draw, [(a, draw) for a, (draw, _) in zip(frontier, combo)])
            weight = p_root_draw * math.prod(prob for _, prob in combo)
            tree, rows = proposal.tree, proposal.draft_probs
            dense = {k: v.dense(4).double() for k, v in rows.items()}
            for (a, child), pa in _emit(tree, ROOT, _P_ROOT, dense.get(ROOT)).items():
                second = ({(b, None): float(_P_CHILD[a][b]) for b in range(4)} if child is None
                          else _emit(tree, child, _P_CHILD[a], dense.get(child)))
                for (b, _), pb in second.items():
                    total[(a, b)] = total.get((a, b), 0.0) + weight * pa * pb
    return total


@pytest.mark.parametrize("max_nodes", [6, 4, 3, 2])
def test_reranked_sampled_trees_are_exactly_lossless(max_nodes, monkeypatch):
    """6 nodes drawn; 6 keeps all, 4 is the default tree's size, 3 and 2 prune across depths (a
    drawn-token score gave total variation 0.009 at 4 and 0.017 at 3)."""
    total = _two_token_distribution(max_nodes, monkeypatch)
    assert sum(total.values()) == pytest.approx(1.0, abs=1e-9)
    tv = 0.5 * sum(abs(total.get((a, b), 0.0) - float(_P_ROOT[a] * _P_CHILD[a][b])) for a in range(4) for b in range(4))
    assert tv < 1e-6  # float32 rows: ~1e-8 of rounding
