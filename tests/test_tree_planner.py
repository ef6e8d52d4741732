"""Network-aware draft trees (client/tree_planner.py): what the planner learns from each step, the
trees it picks as the link and the acceptance change, and that decoding stays exact with it."""
from __future__ import annotations

import copy

import pytest

from splitspec.client.drafters.factory import make_drafter
from splitspec.client.loop import SpeculativeDecoder
from splitspec.client.tree_planner import PlannerConfig, TreePlanner, lookup_tokens, path_ranks
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.models import tokenizer_fingerprint
from splitspec.shared.tree import DraftTree
from splitspec.shared.verifier import CallStats

from .helpers import reference_greedy

# root -> (10, 11); 10 -> (20, 21, 22); 21 -> (30)
TREE = DraftTree((10, 11, 20, 21, 22, 30), (-1, -1, 0, 0, 0, 3))


def test_path_ranks_reads_the_accepted_path():
    assert path_ranks(TREE, []) == [(2, None)]  # the root's two children, none accepted
    assert path_ranks(TREE, [10]) == [(2, 0), (3, None)]
    assert path_ranks(TREE, [10, 21]) == [(2, 0), (3, 1), (1, None)]
    assert path_ranks(TREE, [10, 21, 30]) == [(2, 0), (3, 1), (1, 0)]  # the leaf has no children to offer
    assert path_ranks(TREE, [11]) == [(2, 1)]


def test_lookup_nodes_are_not_the_drafters_ranks():
    """A prompt-lookup chain's nodes (appended after the drafter's) are neither offered nor ranked as
    the drafter's children; the tokens accepted through them are counted apart."""
    # the drafter's tree (nodes 0-2): root -> (10, 11); 10 -> (20); the chain 10, 25, 35 adds nodes 3-4
    tree = DraftTree((10, 11, 20, 25, 35), (-1, -1, 0, 0, 3))
    assert path_ranks(tree, [10, 25, 35]) == [(2, 0), (2, 1), (1, 0)]  # read as a drafter's 2nd child
    assert path_ranks(tree, [10, 25, 35], drafted=3) == [(2, 0), (1, None)]  # the drafter's 20 was rejected
    assert path_ranks(tree, [10, 20], drafted=3) == [(2, 0), (1, 0)]
    assert lookup_tokens(tree, [10, 25, 35], drafted=3) == 2 and lookup_tokens(tree, [10, 20], drafted=3) == 0
    assert lookup_tokens(tree, [10, 25, 35], drafted=None) == 0


def test_what_lookup_chains_add_is_credited_to_every_tree_not_to_wide_ones():
    """Steps where the drafter's top child is accepted at depth 1 and a lookup chain then adds two
    tokens: read as the drafter's, the chain's node is a third-ranked child accepted every time (a
    wider tree would look worth it); read as the chain's, the drafter's children at depth 2 are never
    accepted, and the chain's two tokens are credited to every tree, none to sending no tree."""
    tree = DraftTree((10, 11, 20, 21, 25, 35), (-1, -1, 0, 0, 0, 4))  # drafter: nodes 0-3; chain: 25, 35
    with_lookup, as_drafter = TreePlanner(), TreePlanner()
    for _ in range(60):
        stats = CallStats(100.0, 60.0, 60.0)
        with_lookup.observe(tree, [10, 25, 35], stats, 10.0, drafted=4)
        as_drafter.observe(tree, [10, 25, 35], stats, 10.0)
    assert with_lookup.lookup_gain == pytest.approx(2.0, rel=0.01) and as_drafter.lookup_gain == 0.0
    assert with_lookup.accept_rates()[1, 2] < 0.1 < 0.5 < as_drafter.accept_rates()[1, 2]
    narrow, wide = TreeConfig(2, 1, 2), TreeConfig(2, 3, 6)
    assert with_lookup.expected_tokens(wide) - with_lookup.expected_tokens(narrow) < 0.1
    assert as_drafter.expected_tokens(wide) - as_drafter.expected_tokens(narrow) > 0.3
    assert with_lookup.expected_tokens(narrow) > 3.0 and with_lookup.expected_tokens(None) == 1.0
    assert with_lookup.report()["lookup_gain"] == pytest.approx(2.0, rel=0.01)


def _feed(planner: TreePlanner, link_ms: float, accepted_share: float, steps: int = 60) -> None:
    """Steps whose verify costs 40 ms + 6 ms per position, drafting 10 ms per level, a link of
    `link_ms`, and the top child accepted at the share `accepted_share` of depths (deterministic)."""
    tree = DraftTree.chain([1, 2, 3, 4, 5, 6])
    for i in range(steps):
        depth = 0
        while depth < 6 and (i * 7 + depth * 3) % 100 < accepted_share * 100:
            depth += 1
        forward = 40.0 + 6.0 * (tree.size + 1)
        planner.observe(tree, [1, 2, 3, 4, 5, 6][:depth], CallStats(forward + link_ms, forward, forward), 10.0 * 6)


def test_noise_that_hit_small_calls_does_not_make_big_trees_free():
    """A busy spell that slowed the one-position calls more than the larger ones fitted a negative
    verify slope; clamped at 0 ms, a 25-position verify looked free and the planner chose the largest
    tree. The slope is now never below 0 (a flat cost: what the noisy points allow at most)."""
    planner = TreePlanner()
    for i in range(40):
        size = (1, 4, 8)[i % 3]
        forward = {1: 60.0, 4: 40.0, 8: 30.0}[size]
        tree = DraftTree.chain(list(range(1, size + 1)))
        planner.observe(tree, [1], CallStats(forward + 5.0, forward + 2.0, forward), 5.0)
    line = planner.verify_fit.line(planner.config.verify_slope_prior, 1.0)
    assert line(25) >= line(8) >= line(1) > 0  # it was 0 ms at 25 positions


def test_a_slow_link_buys_deeper_trees():
    fast, slow = TreePlanner(), TreePlanner()
    _feed(fast, link_ms=0.0, accepted_share=0.5)
    _feed(slow, link_ms=200.0, accepted_share=0.5)
    assert slow.link_ms == pytest.approx(200.0, rel=0.05)
    t_fast, t_slow = fast.choose(), slow.choose()
    assert t_slow.depth > t_fast.depth, (t_fast, t_slow)
    assert slow.expected_tokens(t_slow) > fast.expected_tokens(t_fast)


def test_poor_acceptance_buys_small_trees():
    good, poor = TreePlanner(), TreePlanner()
    _feed(good, link_ms=40.0, accepted_share=0.8)
    _feed(poor, link_ms=40.0, accepted_share=0.05)
    assert good.choose() is not None
    assert poor.choose() is None  # nothing pays: one token per call, no drafting
    assert poor.accept_rates()[0, 0] < 0.15 < 0.6 < good.accept_rates()[0, 0]
    assert poor.report()["chosen"] == {"none": 1}


def test_rows_beyond_the_chosen_tree_are_priced():
    """A merged prompt-lookup chain adds rows to every tree the planner asks for: the planner learns
    how many (an EWMA of what the verified trees held beyond the nodes it chose) and prices them into
    every candidate's verify, not into the no-tree step, which carries no chain."""
    planner = TreePlanner()
    for _ in range(40):
        shape = planner.choose()
        size = (shape.max_nodes if shape else 0) + 8  # 8 lookup rows beside whatever was asked for
        forward = 40.0 + 6.0 * (size + 1)
        planner.observe(DraftTree.chain(list(range(1, size + 1))), [1, 2], CallStats(forward, forward, forward), 10.0)
    assert planner.extra_rows == pytest.approx(8.0, rel=0.05)
    assert planner.report()["extra_rows"] == pytest.approx(8.0, rel=0.05)
    unpriced = copy.deepcopy(planner)
    unpriced.extra_rows = 0.0
    shape = TreeConfig(2, 2, 4)
    assert planner.step_ms()(shape) - unpriced.step_ms()(shape) == pytest.approx(8 * 6.0, rel=0.2)  # ~6 ms a row
    assert planner.step_ms()(None) == unpriced.step_ms()(None)
    assert unpriced.choose() is not None
    unpriced.extra_rows = 200.0  # a chain that long makes every tree dearer than one plain token
    assert unpriced.choose() is None


def test_a_costly_commit_is_priced_and_buys_deeper_trees():
    """The drafter's commit after each step (MoA's LSA over the verified positions) is part of every
    step's cost. A fixed cost a step is spread over more tokens by a deeper tree, so a planner that
    measures 150 ms of commit a step picks a tree expected to yield more than one that measures none
    (which is what a planner that left the commit out believed)."""
    light, heavy = TreePlanner(), TreePlanner()
    tree = DraftTree.chain([1, 2, 3, 4, 5, 6])
    for planner, commit in ((light, 0.0), (heavy, 150.0)):
        for i in range(60):
            depth = 0
            while depth < 6 and (i * 7 + depth * 3) % 100 < 60:
                depth += 1
            forward = 40.0 + 6.0 * (tree.size + 1)
            planner.observe(tree, [1, 2, 3, 4, 5, 6][:depth], CallStats(forward, forward, forward), 60.0,
                            commit_ms=commit)
    assert heavy.report()["commit_ms_1"] == pytest.approx(150.0, rel=0.05) and light.report()["commit_ms_1"] == 0.0
    assert heavy.step_ms()(None) - light.step_ms()(None) == pytest.approx(150.0, rel=0.05)
    t_light, t_heavy = light.choose(), heavy.choose()
    assert heavy.expected_tokens(t_heavy) > light.expected_tokens(t_light), (t_light, t_heavy)


def test_the_choice_follows_a_link_change():
    planner = TreePlanner(PlannerConfig(link_alpha=0.3))
    _feed(planner, link_ms=200.0, accepted_share=0.5)
    slow = planner.choose()
    _feed(planner, link_ms=0.0, accepted_share=0.5, steps=15)  # the link got fast: 4g -> lan
    assert planner.link_ms < 2.0
    assert planner.choose().depth < slow.depth
    assert sum(planner.report()["chosen"].values()) == 2


def test_choices_respect_the_limits():
    planner = TreePlanner()
    _feed(planner, link_ms=500.0, accepted_share=0.9)
    tree = planner.choose(max_depth=2, max_nodes=3)
    assert tree.depth <= 2 and tree.max_nodes <= 3


def test_adaptive_trees_decode_exactly(stories, stories_path):
    """The planner changes the tree between steps; the output is still the target's greedy output,
    and the stats say which trees were used."""
    model, tokenizer, model_id = stories
    runner = TargetRunner(model, tokenizer, model_id)
    spec = DrafterSpec.parse(f"draft-model:{stories_path}@layers=3;tree=adaptive")
    assert spec.adaptive and str(spec).endswith("tree=adaptive")
    drafter = make_drafter(spec, target_fingerprint=tokenizer_fingerprint(tokenizer), target=model_id,
                           target_model=model)
    decoder = SpeculativeDecoder(LocalVerifier(runner), drafter, planner=TreePlanner())
    for text in ("Once upon a time", "The little dog"):
        prompt = tokenizer(text)["input_ids"]
        ref = reference_greedy(model, prompt, 48)
        gen = decoder.generate(prompt, len(ref), stop_on_eos=False)
        assert gen.tokens == ref
        assert sum(gen.stats.trees.values()) == gen.stats.target_calls - 1  # one choice per call after the open
        assert "trees" in gen.stats.as_dict()
    # two tokens: the step after the open has room for the bonus token only; it sends no tree, and the
    # stats said "1x1x1" for it (qa session 54)
    assert decoder.planner.verify_fit.points and decoder.planner.offered.sum() > 0
    assert decoder.planner.commit_fit.points  # the drafter's commit after each step is timed and priced
    fresh = SpeculativeDecoder(LocalVerifier(runner), drafter, planner=TreePlanner())  # it sends trees first
    gen = fresh.generate(tokenizer("Once upon a time")["input_ids"], 2, stop_on_eos=False)
    assert gen.stats.trees == {"none": 1} and gen.stats.draft_tokens == 0


def test_a_planner_needs_a_drafter_with_a_tree(stories):
    model, tokenizer, model_id = stories
    from splitspec.client.drafters import NoDrafter

    with pytest.raises(ValueError, match="tree"):
        SpeculativeDecoder(LocalVerifier(TargetRunner(model, tokenizer, model_id)), NoDrafter(), planner=TreePlanner())
    assert TreeConfig(2, 2, 4) in TreePlanner().candidates(6, 64)


def test_no_tree_when_speculation_does_not_pay_stays_exact(stories, stories_path):
    """A planner that has seen nothing accepted sends empty trees (one target token per call, no
    drafting) but for a probe every `probe_every`-th step; the output is still the target's."""
    model, tokenizer, model_id = stories
    drafter = make_drafter(DrafterSpec.parse(f"draft-model:{stories_path}@layers=1"),
                           target_fingerprint=tokenizer_fingerprint(tokenizer), target=model_id, target_model=model)
    planner = TreePlanner(PlannerConfig(prior_accept=0.01, warmup_trees=0))
    decoder = SpeculativeDecoder(LocalVerifier(TargetRunner(model, tokenizer, model_id)), drafter, planner=planner)
    prompt = tokenizer("Once upon a time")["input_ids"]
    gen = decoder.generate(prompt, 20, stop_on_eos=False)
    assert gen.tokens == reference_greedy(model, prompt, 20)
    assert gen.stats.trees == {"none": 17, "1x1x1": 2} and planner.probes == 2 and gen.stats.draft_tokens == 2
    assert len(planner.verify_fit.points) == 19  # it keeps measuring the link and one-token steps


def _rank_logits(rates, depth: int, top_b: int, vocab: int = 4096):
    """Drafter logits whose top-`top_b` probabilities are `rates[depth]` (token id = rank), the rest
    of the mass spread thinly over the other tokens."""
    import torch

    row = torch.tensor(rates[depth, :top_b], dtype=torch.float64)
    rest = (1.0 - float(row.sum())) / (vocab - top_b)
    assert rest < float(row.min())
    return torch.cat([row, torch.full((vocab - top_b,), rest, dtype=torch.float64)]).log()


@pytest.mark.parametrize("shape", [TreeConfig(1, 4, 4), TreeConfig(2, 2, 4), TreeConfig(3, 2, 6),
                                   TreeConfig(4, 3, 9), TreeConfig(6, 2, 8), TreeConfig(5, 4, 24)], ids=str)
def test_expected_tokens_are_those_of_the_tree_eagle2_builds(shape):
    """The planner's expected tokens for a shape equal a Monte Carlo count over the tree the real
    EAGLE-2 builder (client/drafters/dynamic_tree.py) makes when the drafter's probabilities are
    the acceptance chances: walk from the root, accept the rank-r child with chance a_d(r), stop
    at a rejection or a child the tree did not keep."""
    import random

    from splitspec.client.drafters.base import DraftLimits
    from splitspec.client.drafters.dynamic_tree import build_tree
    from splitspec.shared.sampling import SamplingParams
    from splitspec.shared.tree import ROOT

    planner = TreePlanner()
    planner.hits[:6, :4] = [[60, 12, 4, 2], [50, 10, 5, 2], [45, 9, 3, 1], [40, 8, 2, 1], [30, 6, 2, 1], [25, 5, 1, 1]]
    planner.offered[:6, :4] = 100
    rates = planner.accept_rates()
    tree = build_tree(_rank_logits(rates, 0, shape.top_b),
                      lambda frontier, pool: __import__("torch").stack(
                          [_rank_logits(rates, pool[n].depth, shape.top_b) for n in frontier]),
                      shape, DraftLimits(8, 64), SamplingParams()).tree
    assert tree.size == min(shape.max_nodes, shape.top_b + (shape.depth - 1) * shape.top_b ** 2)
    rng, total, trials = random.Random(0), 0, 40_000
    for _ in range(trials):
        node, depth = ROOT, 0
        while depth < 6:
            u, rank = rng.random(), None
            for r in range(shape.top_b):
                u -= rates[depth, r]
                if u < 0:
                    rank = r
                    break
            child = next((c for c in tree.children(node) if tree.tokens[c] == rank), None) if rank is not None else None
            if child is None:
                break
            total, node, depth = total + 1, child, depth + 1
    assert planner.expected_tokens(shape) == pytest.approx(1.0 + total / trials, abs=0.015)


def test_deep_trees_are_not_credited_with_nodes_reranking_drops():
    """With a strong top-ranked child and weak siblings, 24 nodes over 5 levels hold far fewer than
    the 4 a level the old width model gave each depth (N // D): a chain's worth at depth 5, not 4
    siblings' worth; a wide tree's expectation stays below a full width at every level."""
    planner = TreePlanner()
    planner.hits[:6, :4] = [[70, 10, 4, 2]] * 6
    planner.offered[:6, :4] = 100
    rates = planner.accept_rates()
    deep = TreeConfig(5, 4, 24)
    import numpy as np

    width_model = 1.0 + float(np.cumprod(np.minimum(rates[:5, :4].sum(1), 1.0)).sum())
    assert planner.expected_tokens(deep) < width_model - 0.05
    chain = TreeConfig(5, 1, 5)
    assert planner.expected_tokens(chain) == pytest.approx(1.0 + float(np.cumprod(rates[:5, 0]).sum()))
    assert planner.expected_tokens(chain) < planner.expected_tokens(deep)
    assert [planner.expected_tokens(TreeConfig(3, 3, n)) for n in (3, 6, 9)] == sorted(
        planner.expected_tokens(TreeConfig(3, 3, n)) for n in (3, 6, 9))


def _spell_then_recovery(config: PlannerConfig) -> list:
    """A planner that saw a slow spell (40 steps: one-row steps at 100 ms between 7-row trees at
    400 ms, half of them accepting the top child), then runs 64 steps on the real costs: no tree
    100 ms, a tree 100 ms + 5 ms a row, the top child accepted at depth 1 and the second depth
    rejected. Returns the 64 choices."""
    planner = TreePlanner(config)
    tree = DraftTree.chain([1, 2, 3, 4, 5, 6])
    for i in range(40):
        if i % 2:
            planner.observe(DraftTree.empty(), [], CallStats(100.0, 100.0, 100.0), 0.0)
        else:
            planner.observe(tree, [1] if i % 4 else [], CallStats(400.0, 400.0, 400.0), 20.0)
    choices = []
    for _ in range(64):
        shape = planner.choose()
        choices.append(shape)
        if shape is None:
            planner.observe(DraftTree.empty(), [], CallStats(100.0, 100.0, 100.0), 0.0)
        else:
            sent = DraftTree.chain(list(range(1, shape.max_nodes + 1)))
            forward = 100.0 + 5.0 * (sent.size + 1)
            planner.observe(sent, [1], CallStats(forward, forward, forward), 5.0 * shape.depth)
    return choices


def test_a_slow_spell_does_not_keep_the_planner_off_trees():
    """Sending no tree measures neither acceptance nor tree costs: without probes (and with every
    point of the window weighted alike) one slow spell kept the planner on one token per call for the
    whole window (session 46's AVX2 CPU: 6 answers of 28 without a tree). With them it sends the best
    tree every `probe_every`-th step and, the recent costs weighing most, is back on trees within a
    few probes. On these costs a tree pays (2 tokens for ~125 ms against 1 for 100 ms)."""
    stuck = _spell_then_recovery(PlannerConfig(probe_every=10**9, half_life=float("inf")))
    assert all(shape is None for shape in stuck[:60])  # until the spell's points leave the window
    choices = _spell_then_recovery(PlannerConfig())
    assert choices[0] is None and choices[7] is not None  # the first probe
    assert all(shape is not None for shape in choices[40:]) and sum(s is None for s in choices) <= 32, choices


def test_a_fresh_planner_sends_trees_until_it_has_seen_enough():
    """Before `warmup_trees` trees were verified a planner knows only its prior (and no prompt-lookup
    gain), so it sends its best tree even where its model says none pays; then it trusts the model.
    Without the warm-up the same planner sends none from the first step."""
    def run(config: PlannerConfig) -> list:
        planner, choices = TreePlanner(config), []
        for _ in range(24):
            shape = planner.choose()
            choices.append(shape)
            sent = DraftTree.empty() if shape is None else DraftTree.chain(list(range(1, shape.max_nodes + 1)))
            forward = 100.0 + 20.0 * (sent.size + 1)
            planner.observe(sent, [], CallStats(forward, forward, forward), 30.0 * (shape.depth if shape else 0))
        return choices

    warm = run(PlannerConfig(prior_accept=0.01))
    assert all(shape is not None for shape in warm[:16]) and warm[16] is None, warm
    cold = run(PlannerConfig(prior_accept=0.01, warmup_trees=0))
    assert cold[0] is None


def test_probes_are_rare_where_no_tree_pays():
    """Where trees do not pay (poor acceptance), a probe is one step in `probe_every` and is counted."""
    planner = TreePlanner()
    _feed(planner, link_ms=40.0, accepted_share=0.05)
    choices = [planner.choose() for _ in range(24)]
    assert [i for i, shape in enumerate(choices) if shape is not None] == [7, 15, 23]
    assert planner.report()["probes"] == 3 and planner.report()["chosen"]["none"] == 21



def test_the_report_shows_depths_the_sent_trees_reach_less_than_predicted():
    """The per-rank rates count only parents that offered children, so where the drafter expands the
    wrong node (half the steps accept node 10, which has no children; the other half 11 then 20) the
    rates say depth 2 is reached whenever depth 1 is, while the trees sent reach it half the time.
    The reported reach by depth shows it; depth 1 is predicted right. Steps not chosen by the
    planner (an observation without `choose`) add nothing to it."""
    tree = DraftTree((10, 11, 20), (-1, -1, 1))  # root -> (10, 11); 11 -> (20)
    planner = TreePlanner()
    for i in range(200):
        planner.choose()
        planner.observe(tree, [10] if i % 2 else [11, 20], CallStats(100.0, 60.0, 60.0), 10.0)
    predicted, observed = planner.reach_predicted, planner.reach_observed
    assert observed[0] == pytest.approx(predicted[0], rel=0.1), (predicted, observed)
    assert observed[1] == pytest.approx(observed[0] / 2, rel=0.05) and predicted[1] > 1.6 * observed[1]
    report = planner.report()
    assert report["reach_observed"][1] < report["reach_predicted"][1]
    fed = TreePlanner()
    _feed(fed, link_ms=40.0, accepted_share=0.5)
    assert not fed.reach_predicted.any() and not fed.reach_observed.any()


def test_the_reach_predicted_for_chains_is_what_they_reach():
    """Chains (one child a level) accepted level by level with chance 0.7 reach depth k with chance
    0.7 ** k, which the per-depth rates predict: the reported sums agree within 20% at three depths."""
    import random

    rng = random.Random(0)
    planner = TreePlanner(PlannerConfig(top_bs=(1,)))
    for _ in range(400):
        shape = planner.choose() or TreeConfig(1, 1, 1)
        accepted = []
        while len(accepted) < shape.depth and rng.random() < 0.7:
            accepted.append(len(accepted) + 1)
        chain = DraftTree.chain(list(range(1, shape.depth + 1)))
        planner.observe(chain, accepted, CallStats(800.0, 50.0, 50.0), 5.0 * shape.depth)
    predicted, observed = planner.reach_predicted, planner.reach_observed
    assert predicted[2] > 5, predicted  # deep enough chains were sent to judge three depths
    assert all(abs(observed[k] / predicted[k] - 1.0) < 0.2 for k in range(3)), (predicted, observed)
