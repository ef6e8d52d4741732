"""Random streams: the drafter and the target never share one (lossless sampling assumes the draft
is independent of the target's acceptance draws; seed 002, Leviathan et al. 2023, §2.3)."""
from __future__ import annotations

import torch

from splitspec.client.drafters import DraftModelDrafter
from splitspec.server.runner import TargetRunner
from splitspec.shared.features import FeatureRequest
from splitspec.shared.sampling import SamplingParams, Stream, make_generator, stream_seed


def test_stream_seeds_differ_by_role_and_repeat_from_the_user_seed():
    seeds = {stream: stream_seed(7, stream) for stream in Stream}
    assert len(set(seeds.values())) == len(Stream)
    assert seeds == {stream: stream_seed(7, stream) for stream in Stream}
    assert stream_seed(7, Stream.TARGET) != stream_seed(8, Stream.TARGET)
    assert all(0 <= s < 2**63 for s in seeds.values())
    same = [torch.rand(4, generator=make_generator(7, Stream.DRAFTER)) for _ in range(2)]
    assert torch.equal(*same)


def test_drafter_and_target_session_draw_from_different_streams(tiny_random):
    """Built from one user seed, the drafter's uniforms and the target session's share no value in
    their first 2,048 draws. When both were seeded with the seed itself (the defect this guards
    against), the target's acceptance draws replayed the drafter's, offset by the first token."""
    model, tokenizer, model_id = tiny_random
    sampling = SamplingParams(temperature=1.0, seed=5)
    session, _, _ = TargetRunner(model, tokenizer, model_id).open([1, 5, 9], sampling, FeatureRequest())
    drafter = DraftModelDrafter(model, seed=sampling.seed)
    target_draws = set(torch.rand(2048, generator=session.generator).tolist())
    drafter_draws = set(torch.rand(2048, generator=drafter.generator).tolist())
    assert not target_draws & drafter_draws


def test_a_reopened_session_draws_fresh_uniforms(tiny_random):
    """A session lost at the first Verify call is re-opened one token on; its draws must not replay
    those that drew the answer's first token. With a target whose next-token distribution barely
    depends on the context, the second token then equals the first about as often as the target's
    own p(a) p(a | a) (near 0); replayed uniforms made it equal nearly always (266/300 seeds)."""
    from splitspec.client.drafters import NoDrafter
    from splitspec.client.loop import SpeculativeDecoder

    from .helpers import FAST, FlakyVerifier

    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer, _ = tiny_random
    torch.manual_seed(0)  # small weights: next-token distributions nearly the same in every context
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         initializer_range=0.05, bos_token_id=1, eos_token_id=2)).eval()
    runner = TargetRunner(model.requires_grad_(False), tokenizer, "flat")
    prompt, seeds, same = [1, 45, 99, 300], range(60), 0
    for seed in seeds:
        verifier = FlakyVerifier(runner, {1: "lost"}, down_probes=0)
        gen = SpeculativeDecoder(verifier, NoDrafter(), FAST).generate(
            prompt, 2, SamplingParams(temperature=1.0, seed=seed), stop_on_eos=False)
        assert gen.stats.reopened_sessions == 1
        same += gen.tokens[0] == gen.tokens[1]
    assert same <= 5, f"{same}/{len(seeds)} answers repeat their first token after the re-open"
