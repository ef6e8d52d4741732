"""End to end through the gRPC verify service: sampled split decoding follows the target's own
distribution (the statistical test of shared/acceptance.py, here with a real drafter, the wire's
draft probabilities and the server's seeded session)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from splitspec.client.drafters import DraftModelDrafter
from splitspec.client.loop import SpeculativeDecoder
from splitspec.client.transport import RemoteVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.config import TreeConfig
from splitspec.shared.models import load_model
from splitspec.shared.sampling import SamplingParams, warp_probs

SAMPLING = SamplingParams(temperature=1.0, top_k=2)
ANSWERS = 200


def _target_pairs(model, prompt: list[int]) -> dict[tuple[int, int], float]:
    """The target's probability of each first two tokens (t1, t2) under SAMPLING."""
    with torch.inference_mode():
        first = warp_probs(model(torch.tensor([prompt])).logits[0, -1], SAMPLING)
        pairs = {}
        for t1 in first.nonzero().flatten().tolist():
            second = warp_probs(model(torch.tensor([prompt + [t1]])).logits[0, -1], SAMPLING)
            pairs |= {(t1, t2): float(first[t1] * second[t2]) for t2 in second.nonzero().flatten().tolist()}
    return pairs


@pytest.mark.slow  # 40-180 s on a loaded 2-core VM; shared/acceptance.py's own statistical tests stay in the default tier
def test_split_sampling_follows_the_target_distribution(stories, stories_path, serve):
    """The first token comes from the open call, the second from a Verify step whose depth-1 tree
    the early-exit drafter sampled: their joint distribution over ANSWERS seeded answers is the
    target's (TV < 0.12; about 0.05 is expected from sampling noise alone)."""
    model, tokenizer, model_id = stories
    verifier = RemoteVerifier(serve(TargetRunner(model, tokenizer, model_id)).address)
    draft, _, _ = load_model(f"{stories_path}@layers=2")
    decoder = SpeculativeDecoder(verifier, DraftModelDrafter(draft, TreeConfig(depth=1, top_b=2, max_nodes=2)))
    prompt = tokenizer("Lily saw a big")["input_ids"]
    counts = Counter()
    for seed in range(ANSWERS):
        gen = decoder.generate(prompt, 3, SamplingParams(SAMPLING.temperature, top_k=SAMPLING.top_k, seed=seed),
                               stop_on_eos=False)
        counts[tuple(gen.tokens[:2])] += 1
    verifier.close()
    expected = _target_pairs(model, prompt)
    assert set(counts) <= set(expected)
    tv = 0.5 * sum(abs(counts[pair] / ANSWERS - p) for pair, p in expected.items())
    assert tv < 0.12, (counts, expected)
