"""The acceptance rule: hand-written greedy cases and a seeded statistical test that tree
speculative sampling reproduces the target distribution."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from splitspec.shared.acceptance import AcceptResult, SparseProbs, accept_greedy, accept_sampling
from splitspec.shared.sampling import SamplingParams, warp_probs
from splitspec.shared.tree import ROOT, DraftTree

V = 6


def _logits_with_argmax(rows: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(rows), V)
    for i, t in enumerate(rows):
        logits[i, t] = 5.0
    return logits


def test_greedy_perfect_match():
    tree = DraftTree.chain([3, 1, 4])
    result = accept_greedy(tree, _logits_with_argmax([3, 1, 4, 5]))
    assert result.accepted_nodes == (0, 1, 2) and result.bonus_token == 5


def test_greedy_early_mismatch():
    tree = DraftTree.chain([3, 1, 4])
    result = accept_greedy(tree, _logits_with_argmax([2, 1, 4, 5]))
    assert result.accepted_nodes == () and result.bonus_token == 2


def test_greedy_picks_matching_sibling():
    tree = DraftTree((1, 3, 2, 0), (-1, -1, 1, 1))  # root -> {1, 3}; 3 -> {2, 0}
    result = accept_greedy(tree, _logits_with_argmax([3, 5, 0, 4, 4]))
    assert result.accepted_nodes == (1, 3) and result.bonus_token == 4


def test_greedy_empty_draft():
    result = accept_greedy(DraftTree.empty(), _logits_with_argmax([2]))
    assert result.accepted_nodes == () and result.bonus_token == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ties_go_to_the_first_maximal_token_as_argmax(dtype):
    """generate() takes argmax (the first maximal id on a tie); bf16 logits tie often. Drafts of the
    later tied id are rejected and the bonus is the earlier one, on a wide vocabulary too (where a
    CPU reduces in vectorised blocks)."""
    vocab = 49152
    logits = torch.zeros(2, vocab, dtype=dtype)
    logits[0, [7, 30000, 49000]] = 3.0  # three-way tie at the root
    logits[1, [2, 40000]] = 1.0
    result = accept_greedy(DraftTree((30000, 49000), (-1, -1)), logits[[0, 1, 1]])
    assert result.accepted_nodes == () and result.bonus_token == 7
    result = accept_greedy(DraftTree((30000, 7), (-1, -1)), logits[[0, 1, 1]])
    assert result.accepted_nodes == (1,) and result.bonus_token == 2
    torch.manual_seed(0)
    many = (torch.randn(64, vocab) * 2).round().to(dtype)  # many ties per row
    chosen = [accept_greedy(DraftTree.empty(), row[None]).bonus_token for row in many]
    assert chosen == many.argmax(-1).tolist()


def _first_tokens_distribution(tree, logits, params, rows, n, seed):
    """Empirical distribution of the first emitted token (accepted depth-1 node or bonus)."""
    gen = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(n):
        res = accept_sampling(tree, logits, params, rows, gen)
        first = tree.tokens[res.accepted_nodes[0]] if res.accepted_nodes else res.bonus_token
        counts[first] += 1
    return torch.tensor([counts[t] / n for t in range(V)])


def _draw_without_replacement(q: torch.Tensor, k: int, gen) -> list[int]:
    q = q.clone()
    out = []
    for _ in range(k):
        t = int(torch.multinomial(q / q.sum(), 1, generator=gen))
        out.append(t)
        q[t] = 0
    return out


PARAMS = SamplingParams(temperature=0.8, top_p=0.95, top_k=5)
TV_BOUND = 0.02  # total variation a correct rule stays under with 6000 draws


def _bonus_from_target(tree, logits, params, rows, gen):
    """A broken rule: siblings accepted in turn with min(1, p/q) without renormalising the target
    after a rejection, and the bonus token drawn from p instead of the residual."""
    p, q = warp_probs(logits[0], params), rows[ROOT].probs
    for node, token in enumerate(tree.tokens):
        if torch.rand((), generator=gen) < min(1.0, float(p[token] / q[token])):
            return AcceptResult((node,), -1, recovered=False)
    return AcceptResult((), int(torch.multinomial(p, 1, generator=gen)), recovered=True)


def _first_token_tv(siblings: int, rule=accept_sampling, n: int = 6000) -> float:
    """Siblings drawn without replacement from q (fresh each trial) and tried in turn by `rule`: the
    total variation between the first emitted token's empirical distribution and the warped target p."""
    torch.manual_seed(0)
    target_logits = torch.randn(1 + siblings + 1, V) * 2
    draft_q = torch.softmax(torch.randn(V) * 2, -1)
    p = warp_probs(target_logits[0], PARAMS)
    gen = torch.Generator().manual_seed(1)
    counts = Counter()
    for _ in range(n):
        kids = _draw_without_replacement(draft_q, siblings, gen)
        tree = DraftTree(tuple(kids), (-1,) * siblings)
        rows = {ROOT: SparseProbs(torch.arange(V), draft_q)}
        res = rule(tree, target_logits[: siblings + 1], PARAMS, rows, gen)
        counts[tree.tokens[res.accepted_nodes[0]] if res.accepted_nodes else res.bonus_token] += 1
    empirical = torch.tensor([counts[t] / n for t in range(V)])
    return float(0.5 * (empirical - p).abs().sum())


@pytest.mark.parametrize("siblings", [1, 3])
def test_sampling_matches_target_distribution(siblings):
    """Siblings drawn without replacement from q, tried in turn: the first emitted token must
    follow the warped target distribution p (TV distance < TV_BOUND over 6000)."""
    assert _first_token_tv(siblings) < TV_BOUND


@pytest.mark.parametrize("siblings", [1, 3])
def test_a_broken_rule_is_detected(siblings):
    """The test's power: the same experiment with a broken rule (bonus from p, no residual) fails it."""
    assert _first_token_tv(siblings, rule=_bonus_from_target) > TV_BOUND


def test_sampling_chain_second_token():
    """Along a chain, once the first draft token is accepted, the next emitted token follows the
    target's p at that node (second draft token drawn from q1, accepted or corrected)."""
    torch.manual_seed(2)
    logits = torch.randn(3, V) * 2
    q1 = torch.softmax(torch.randn(V), -1)
    first = int(warp_probs(logits[0], PARAMS).argmax())  # proposed deterministically (one-hot row)
    gen = torch.Generator().manual_seed(3)
    p1 = warp_probs(logits[1], PARAMS)
    counts, total = Counter(), 0
    for _ in range(8000):
        tree = DraftTree.chain([first, int(torch.multinomial(q1, 1, generator=gen))])
        res = accept_sampling(tree, logits, PARAMS, {0: SparseProbs(torch.arange(V), q1)}, gen)
        if res.accepted_nodes[:1] == (0,):
            counts[tree.tokens[1] if len(res.accepted_nodes) > 1 else res.bonus_token] += 1
            total += 1
    assert total > 2000
    empirical = torch.tensor([counts[t] / total for t in range(V)])
    assert 0.5 * (empirical - p1).abs().sum() < 0.04, (empirical, p1, total)


def test_sampling_one_hot_proposals():
    """Deterministic siblings (no draft probabilities) keep the distribution too."""
    torch.manual_seed(4)
    logits = torch.randn(3, V) * 2
    tree = DraftTree((1, 4), (-1, -1))
    p = warp_probs(logits[0], PARAMS)
    empirical = _first_tokens_distribution(tree, logits, PARAMS, {}, 6000, seed=5)
    assert 0.5 * (empirical - p).abs().sum() < 0.02, (empirical, p)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [0, 1, 5])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_warped_probabilities_equal_transformers_sampling(temperature, top_k, top_p):
    """The distribution every sampling test takes as the target's (`warp_probs`) is the one
    transformers' `generate(do_sample=True)` samples from: its temperature, top-k and top-p warpers,
    in that order (random logits: no ties at the cut-offs)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 3
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)
    expected = torch.softmax(warped, dim=-1)
    got = warp_probs(logits, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(got > 0, expected > 0)  # the same tokens kept


def test_top_k_1_is_greedy_decoding():
    """All of top-k 1's probability is on the argmax, at any temperature: client and server take it
    as greedy (both read the same property from the same wire values)."""
    from splitspec.shared.sampling import SamplingParams
    from splitspec.v1 import verify_pb2 as pb

    assert SamplingParams(0.9, 0.95, 1, 7).greedy and SamplingParams(0.0).greedy
    assert not SamplingParams(0.9, 1.0, 2).greedy and not SamplingParams(0.9).greedy
    assert SamplingParams.from_pb(SamplingParams(0.9, 1.0, 1).to_pb(pb.SamplingParams)).greedy
