"""End to end through the gRPC verify service: sampled split decoding follows the target's own
distribution (the statistical test of shared/acceptance.py, here with a real drafter, the wire's
draft probabilities and the server's seeded session)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from splitspec.client.drafters import DraftModelDrafter
from splitspec.client.drafters.ngram import PromptLookupMerge
from splitspec.client.loop import SpeculativeDecoder
from splitspec.client.transport import RemoteVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.config import TreeConfig
from splitspec.shared.models import load_model
from splitspec.shared.sampling import SamplingParams, warp_probs

from .helpers import reference_greedy

SAMPLING = SamplingParams(temperature=1.0, top_k=2)
ANSWERS = 200


def _target_joint(model, prompt: list[int], n: int) -> dict[tuple[int, ...], float]:
    """The target's probability of each first `n` tokens under SAMPLING (top-k 2: at most 2^n)."""
    with torch.inference_mode():
        probs = warp_probs(model(torch.tensor([prompt])).logits[0, -1], SAMPLING)
    heads = {(t,): float(probs[t]) for t in probs.nonzero().flatten().tolist()}
    if n == 1:
        return heads
    return {head + tail: p * q for head, p in heads.items()
            for tail, q in _target_joint(model, prompt + list(head), n - 1).items()}


@pytest.mark.slow  # 40-180 s on a loaded 2-core VM; shared/acceptance.py's own statistical tests stay in the default tier
@pytest.mark.parametrize("lookup", [False, True])
def test_split_sampling_follows_the_target_distribution(stories, stories_path, serve, lookup):
    """The first token comes from the open call, the next from Verify steps whose depth-1 trees
    the early-exit drafter sampled: the joint distribution of the first tokens over the seeded
    answers is the target's (TV < 0.12; about 0.05 is expected from sampling noise alone). With
    prompt lookup the prompt repeats itself, chains grow below the sampled nodes (one-hot
    proposals at depth 2 and on), some of their tokens are accepted, and the first three tokens
    are compared."""
    model, tokenizer, model_id = stories
    verifier = RemoteVerifier(serve(TargetRunner(model, tokenizer, model_id)).address)
    draft, _, _ = load_model(f"{stories_path}@layers=2")
    drafter = DraftModelDrafter(draft, TreeConfig(depth=1, top_b=2, max_nodes=2))
    if lookup:
        drafter = PromptLookupMerge(drafter, depth=4)
    decoder = SpeculativeDecoder(verifier, drafter)
    prompt = tokenizer("Lily saw a big")["input_ids"]
    if lookup:  # the prompt, the target's greedy next 3 tokens, the prompt again: its answers start by copying
        prompt = prompt + reference_greedy(model, prompt, 3) + prompt[1:]
    n, answers = (3, 3 * ANSWERS) if lookup else (2, ANSWERS)
    counts = Counter()
    for seed in range(answers):
        gen = decoder.generate(prompt, n + 3, SamplingParams(SAMPLING.temperature, top_k=SAMPLING.top_k, seed=seed),
                               stop_on_eos=False)
        counts[tuple(gen.tokens[:n])] += 1
    verifier.close()
    if lookup:
        assert drafter.stats["lookup_accepted"] > 0, drafter.stats
    expected = _target_joint(model, prompt, n)
    assert set(counts) <= set(expected)
    tv = 0.5 * sum(abs(counts[head] / answers - p) for head, p in expected.items())
    assert tv < 0.12, (counts, expected)


@pytest.mark.parametrize("lookup", [False, True])
def test_a_seed_gives_the_same_sampled_answer_whatever_came_before(stories, stories_path, lookup):
    """The drafter's random stream restarts from each answer's seed: the same seed gives the same
    answer after answers with other seeds (it drifted with them before, which the daemon's QA found:
    the same request and seed, another text on the second call)."""
    from splitspec.server.local import LocalVerifier

    model, tokenizer, model_id = stories
    draft, _, _ = load_model(f"{stories_path}@layers=2")
    drafter = DraftModelDrafter(draft, TreeConfig(depth=2, top_b=2, max_nodes=4))
    if lookup:
        drafter = PromptLookupMerge(drafter, depth=4)
    decoder = SpeculativeDecoder(LocalVerifier(TargetRunner(model, tokenizer, model_id)), drafter)
    prompt = tokenizer("Lily saw a big")["input_ids"]
    sampling = lambda seed: SamplingParams(temperature=1.0, seed=seed)  # noqa: E731
    first = decoder.generate(prompt, 24, sampling(5), stop_on_eos=False)
    others = [decoder.generate(prompt, 24, sampling(s), stop_on_eos=False).tokens for s in (6, 7)]
    again = decoder.generate(prompt, 24, sampling(5), stop_on_eos=False)
    assert again.tokens == first.tokens and again.stats.target_calls == first.stats.target_calls
    assert any(o != first.tokens for o in others)
