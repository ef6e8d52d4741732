"""Lossless greedy decoding: split-mode and single-device outputs equal target-only generate()."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from splitspec.client.drafters import DraftModelDrafter, NgramDrafter
from splitspec.client.loop import SpeculativeDecoder
from splitspec.client.transport import RemoteVerifier
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.config import TreeConfig
from splitspec.shared.models import early_exit, encode_chat, load_model

from .helpers import SPEC_BENCH, OracleDrafter, reference_greedy

N_NEW = 60


def _drafters(model_name: str, prompt, ref, vocab, draft_model):
    return {
        "always-right": OracleDrafter(prompt, ref, vocab, right=True, depth=4, wrong_siblings=2),
        "always-wrong": OracleDrafter(prompt, ref, vocab, right=False, depth=3, wrong_siblings=2),
        "ngram": NgramDrafter(),
        "draft-model": DraftModelDrafter(draft_model, TreeConfig(depth=4, top_b=3, max_nodes=12)),
    }


def _check_all(verifier, drafters, prompt, ref, *, min_calls_right: int):
    for name, drafter in drafters.items():
        gen = SpeculativeDecoder(verifier, drafter).generate(prompt, len(ref), stop_on_eos=False)
        assert gen.tokens == ref, f"{name}: output differs from target-only greedy decoding"
        if name == "always-right":
            assert gen.stats.target_calls <= min_calls_right, f"always-right drafter accepted too little: {gen.stats}"
            assert gen.stats.tau > 3.0
        if name == "always-wrong":
            assert gen.stats.target_calls == len(ref), "an always-wrong drafter must get exactly one token per call"


@pytest.mark.parametrize("mode", ["local", "split"])
def test_tiny_random_llama(tiny_random, serve, mode):
    model, tokenizer, model_id = tiny_random
    prompt = [1, 45, 300, 17, 99, 4, 250]
    ref = reference_greedy(model, prompt, N_NEW)
    runner = TargetRunner(model, tokenizer, model_id)
    verifier = LocalVerifier(runner) if mode == "local" else RemoteVerifier(serve(runner).address)

    small = copy.deepcopy(model)
    early_exit(small, 1)
    drafters = _drafters(model_id, prompt, ref, 512, small)
    _check_all(verifier, drafters, prompt, ref, min_calls_right=1 + -(-(N_NEW - 1) // 5))


@pytest.mark.parametrize("mode", ["local", "split"])
def test_stories260k(stories, stories_path, serve, mode):
    model, tokenizer, model_id = stories
    prompt = tokenizer("Once upon a time, there was a little dog named Max. Max liked to")["input_ids"]
    ref = reference_greedy(model, prompt, N_NEW)
    runner = TargetRunner(model, tokenizer, model_id)
    verifier = LocalVerifier(runner) if mode == "local" else RemoteVerifier(serve(runner).address)
    draft, _, _ = load_model(f"{stories_path}@layers=2")
    drafters = _drafters(model_id, prompt, ref, 512, draft)
    _check_all(verifier, drafters, prompt, ref, min_calls_right=1 + -(-(N_NEW - 1) // 5))


@pytest.mark.slow
def test_smollm2_spec_bench_split(smollm2, serve):
    model, tokenizer, model_id = smollm2
    question = json.loads(SPEC_BENCH.read_text().splitlines()[0])
    prompt = encode_chat(tokenizer, [{"role": "user", "content": question["turns"][0]}])
    n = 40
    ref = reference_greedy(model, prompt, n)
    runner = TargetRunner(model, tokenizer, model_id)
    verifier = RemoteVerifier(serve(runner).address)
    draft, _, _ = load_model("smollm2-135m@layers=6")
    drafters = {
        "always-right": OracleDrafter(prompt, ref, model.config.vocab_size, right=True, depth=4),
        "always-wrong": OracleDrafter(prompt, ref, model.config.vocab_size, right=False, depth=2),
        "ngram": NgramDrafter(),
        "draft-model": DraftModelDrafter(draft, TreeConfig(depth=3, top_b=3, max_nodes=10)),
    }
    for name, drafter in drafters.items():
        gen = SpeculativeDecoder(verifier, drafter).generate(prompt, n, stop_on_eos=False)
        assert gen.tokens == ref, name
    local = SpeculativeDecoder(LocalVerifier(runner), NgramDrafter()).generate(prompt, n, stop_on_eos=False)
    assert local.tokens == ref


def test_sampling_split_with_draft_model(stories, stories_path, serve):
    """Sampled drafting sends draft probabilities the server accepts; runs are seeded."""
    from splitspec.shared.sampling import SamplingParams

    model, tokenizer, model_id = stories
    verifier = RemoteVerifier(serve(TargetRunner(model, tokenizer, model_id)).address)
    draft, _, _ = load_model(f"{stories_path}@layers=3")
    prompt = tokenizer("One day, a little bird")["input_ids"]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    runs = [SpeculativeDecoder(verifier, DraftModelDrafter(draft, TreeConfig(depth=3, top_b=2, max_nodes=6), seed=3))
            .generate(prompt, 40, params, stop_on_eos=False) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 40
    assert runs[0].stats.tau > 1.0  # some drafts were accepted under sampling
    greedy = SpeculativeDecoder(verifier, DraftModelDrafter(draft, TreeConfig(depth=3, top_b=2, max_nodes=6)))
    plain = greedy.generate(prompt, 40, stop_on_eos=False)  # no draft probabilities travel when greedy
    per_call = lambda g: g.stats.bytes_sent / g.stats.target_calls  # noqa: E731
    assert per_call(runs[0]) > per_call(plain) + 100


def test_one_token_answer_has_json_stats(tiny_random):
    """An answer of one token (the open call's, no verify call) has an undefined tau: its stats say
    null, not NaN, which is not JSON (the daemon's response failed on it)."""
    model, tokenizer, model_id = tiny_random
    prompt = [1, 45, 300, 17, 99, 4, 250]
    gen = SpeculativeDecoder(LocalVerifier(TargetRunner(model, tokenizer, model_id)), NgramDrafter()).generate(
        prompt, 1, stop_on_eos=False)
    assert gen.tokens == reference_greedy(model, prompt, 1) and gen.stats.target_calls == 1
    stats = gen.stats.as_dict()
    assert stats["tau"] is None
    json.dumps(stats, allow_nan=False)
    assert "tau -," in gen.stats.summary()
    two = SpeculativeDecoder(LocalVerifier(TargetRunner(model, tokenizer, model_id)), NgramDrafter()).generate(
        prompt, 3, stop_on_eos=False)
    assert two.stats.as_dict()["tau"] == round(two.stats.tau, 3) > 0


@pytest.mark.parametrize("mode", ["local", "split"])
def test_the_answer_stops_where_the_targets_context_is_full(tiny_random, serve, mode):
    """An answer asked for more tokens than the target's context holds ends there, equal to the
    target's greedy tokens, with every step's tree cut to the room left (the server refused the step
    that overflowed it, and the chat command ended, before: QA); a prompt that fills the context is
    refused before any call."""
    from splitspec.shared.config import ServerLimits

    model, tokenizer, model_id = tiny_random
    prompt = [1, 45, 300, 17, 99, 4, 250]
    context = 30
    runner = TargetRunner(model, tokenizer, model_id)
    if mode == "split":
        verifier = RemoteVerifier(serve(runner, ServerLimits(max_context=context)).address)
    else:
        verifier = LocalVerifier(runner)
        verifier.info = dataclasses.replace(verifier.info, max_context=context)
    ref = reference_greedy(model, prompt, context - len(prompt))
    for drafter in (OracleDrafter(prompt, ref, 512, right=True, depth=4, wrong_siblings=2), NgramDrafter()):
        gen = SpeculativeDecoder(verifier, drafter).generate(prompt, 100, stop_on_eos=False)
        assert gen.tokens == ref and gen.context_full
    short = SpeculativeDecoder(verifier, NgramDrafter()).generate(prompt, 5, stop_on_eos=False)
    assert short.tokens == ref[:5] and not short.context_full
    with pytest.raises(ValueError, match="fill the target's context"):
        SpeculativeDecoder(verifier, NgramDrafter()).generate(list(range(1, context + 1)), 4)
