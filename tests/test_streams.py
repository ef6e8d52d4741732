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
