"""SWIFT (seed 000, client/drafters/swift.py): drafting from the target's own reused K/V with
layers skipped, its layer-set search, and lossless decoding through the common loop in
single-device and split mode."""
from __future__ import annotations

import pytest

from splitspec.client.drafters.factory import make_drafter
from splitspec.client.drafters.ngram import PromptLookupMerge
from splitspec.client.drafters.swift import PAPER_BANDS, SkipSetSearch, SwiftConfig, SwiftDrafter, uniform_skip_set
from splitspec.client.loop import SpeculativeDecoder
from splitspec.client.transport import RemoteVerifier
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.models import tokenizer_fingerprint
from splitspec.shared.sampling import SamplingParams

from .helpers import reference_greedy

PROMPT_TEXT = "Once upon a time there was a little girl who"


def _prompt(tokenizer) -> list[int]:
    return tokenizer(PROMPT_TEXT)["input_ids"]


def _decode(verifier, drafter, prompt, n, **kw):
    return SpeculativeDecoder(verifier, drafter).generate(prompt, n, stop_on_eos=False, **kw)


def test_with_no_layer_skipped_every_draft_is_accepted(stories):
    """Skip nothing, draft a chain to the end: the drafter is the target on the target's own K/V, so
    all of its drafts are accepted; any error in the reused cache, positions or masks would show."""
    model, tokenizer, model_id = stories
    prompt = _prompt(tokenizer)
    ref = reference_greedy(model, prompt, 64)
    drafter = SwiftDrafter(model, SwiftConfig(ratio=0.0, epsilon=0.0, bands=((1.0, 1),), max_depth=6, max_nodes=6))
    gen = _decode(LocalVerifier(TargetRunner(model, tokenizer, model_id)), drafter, prompt, len(ref))
    assert gen.tokens == ref
    assert gen.stats.tau == pytest.approx(7.0, abs=0.3)  # 6 drafted + 1 bonus per call, short last call aside


def test_matchness_of_the_full_model_is_one(stories):
    """The parallel window forward of §4.1.2 reproduces the target's greedy tokens when nothing is
    skipped, and scores lower with layers skipped."""
    model, tokenizer, model_id = stories
    prompt = _prompt(tokenizer)
    drafter = SwiftDrafter(model, SwiftConfig(ratio=0.0, window=16, max_steps=0))
    _decode(LocalVerifier(TargetRunner(model, tokenizer, model_id)), drafter, prompt, 48)
    assert drafter.verified - len(prompt) >= 16
    assert drafter.matchness(()) == 1.0
    assert drafter.matchness((1, 2, 3)) < 1.0
    short = SwiftDrafter(model, SwiftConfig(ratio=0.0, window=16, max_steps=0))
    _decode(LocalVerifier(TargetRunner(model, tokenizer, model_id)), short, prompt, 8)
    assert short.matchness(()) is None  # fewer than `window` generated tokens verified


@pytest.mark.parametrize("mode", ["local", "split"])
def test_greedy_equality_with_skipped_layers(stories, serve, mode):
    """Layers skipped, the search running, sibling sets from the confidence bands (accepted paths
    that skip rows): the output is the target's greedy output, in both modes."""
    model, tokenizer, model_id = stories
    runner = TargetRunner(model, tokenizer, model_id)
    verifier = LocalVerifier(runner) if mode == "local" else RemoteVerifier(serve(runner).address)
    config = SwiftConfig(ratio=0.4, window=8, bo_every=3, max_steps=30, patience=30, bands=PAPER_BANDS, max_nodes=16)
    drafter = SwiftDrafter(model, config)
    for text in (PROMPT_TEXT, "The dog and the cat", "Lily wanted to"):
        prompt = tokenizer(text)["input_ids"]
        ref = reference_greedy(model, prompt, 60)
        gen = _decode(verifier, drafter, prompt, len(ref))
        assert gen.tokens == ref, f"{mode}: {text!r}"
        assert gen.stats.tau > 1.2
    assert drafter.search.steps > 5  # the search ran, Bayesian steps included
    assert len(drafter.search.best) == 2  # round(0.4 * 5) of the middle layers 1..3


def test_sampling_runs_and_is_reproducible(stories):
    model, tokenizer, model_id = stories
    prompt = _prompt(tokenizer)
    runner = TargetRunner(model, tokenizer, model_id)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    outs = []
    for _ in range(2):
        drafter = SwiftDrafter(model, SwiftConfig(ratio=0.4, window=8, seed=3))
        outs.append(_decode(LocalVerifier(runner), drafter, prompt, 40, sampling=sampling).tokens)
    assert outs[0] == outs[1] and len(outs[0]) == 40


def test_search_is_deterministic_under_a_seed_and_keeps_its_size():
    def run(seed):
        search = SkipSetSearch(tuple(range(1, 29)), 9, SwiftConfig(seed=seed, bo_every=4, max_steps=40, patience=40))
        for _ in range(24):
            skip = search.propose()
            assert len(skip) == 9 == len(set(skip)) and set(skip) <= set(range(1, 29)), skip
            # a made-up objective: the fewer late layers skipped, the better
            search.record(skip, 1.0 - sum(i > 20 for i in skip) / 9)
        return search.history, search.best

    assert run(0) == run(0)
    assert run(0) != run(1)
    history, best = run(0)
    assert history[0][1] == uniform_skip_set(tuple(range(1, 29)), 9)  # the paper's starting point
    assert max(m for _, _, m in history) == 1.0 - sum(i > 20 for i in best) / 9


def test_search_stops():
    search = SkipSetSearch((1, 2, 3, 4), 2, SwiftConfig(max_steps=100, patience=3, stop_matchness=0.9))
    for m in (0.5, 0.4, 0.4, 0.4):
        assert not search.done
        search.record(search.propose(), m)
    assert search.done  # 3 steps without gain
    search = SkipSetSearch((1, 2, 3, 4), 2, SwiftConfig(stop_matchness=0.9))
    search.record(search.propose(), 0.95)
    assert search.done
    assert SkipSetSearch((1, 2, 3), 0, SwiftConfig()).done  # nothing to search


def test_spec_and_factory(stories):
    model, tokenizer, model_id = stories
    assert DrafterSpec.parse("swift").kind == "swift"
    spec = DrafterSpec.parse("swift:ratio=0.4")
    assert spec.ratio == 0.4 and str(spec) == "swift:ratio=0.4"
    for bad in ("swift:ratio=1.5", "swift:ratio=x", "swift:depth=3", "swift:ratio=0.2;lsa=bogus"):
        with pytest.raises(ValueError):
            DrafterSpec.parse(bad)
    drafter = make_drafter(spec, target_fingerprint=tokenizer_fingerprint(tokenizer), target=model_id,
                           target_model=model)
    assert isinstance(drafter, PromptLookupMerge) and isinstance(drafter.inner, SwiftDrafter)  # lookup: on by default
    assert drafter.config.ratio == 0.4
    assert isinstance(make_drafter(DrafterSpec.parse("swift:ratio=0.4;lookup=0"), target_fingerprint=tokenizer_fingerprint(
        tokenizer), target=model_id, target_model=model), SwiftDrafter)
    assert drafter.feature_request.kv_layers == tuple(range(model.config.num_hidden_layers))
    with pytest.raises(ValueError, match="target"):
        make_drafter(spec, target_fingerprint="x", target=None)
