"""The Falcon drafter (seed 004): its runtime drafts what its training forward computes (root
block and the next block of the custom tree, across cached context and cuts), and decoding with
it stays exact; CSGD trains it."""
from __future__ import annotations

import random

import pytest
import torch

from splitspec.client.drafters import DraftLimits
from splitspec.client.drafters.falcon import FalconRuntime
from splitspec.client.loop import SpeculativeDecoder
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.falcon import FalconConfig, FalconDrafter, block_ends
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.drafters.target_parts import TargetParts
from splitspec.shared.features import FeatureBatch
from splitspec.shared.sampling import SamplingParams
from splitspec.train.batched import LossOptions, falcon_forward_batch, falcon_loss_batch, make_batch, run_target_batch
from splitspec.train.data import Example

from .helpers import check_seeded_sampling, reference_greedy


@pytest.fixture(scope="module")
def falcon(stories):
    model, _, _ = stories
    torch.manual_seed(0)
    return FalconDrafter(FalconConfig.from_target(model.config)).eval()


def _features(model, ids: list[int]) -> torch.Tensor:
    """The target's final normed states [len(ids), E]."""
    target = run_target_batch(model, make_batch([Example(ids, [1] * len(ids))]))
    return target.final[0]


def test_block_ends():
    assert block_ends(7, 0).tolist() == [1, 1, 3, 3, 5, 5, 6]
    assert block_ends(6, 1).tolist() == [0, 2, 2, 4, 4, 5]


@torch.no_grad()
def test_runtime_drafts_what_training_computes(stories, falcon):
    """Root block (slots p-2, p-1 with the target's features) and one tree block (a depth-1 node and
    its depth-2 child, fed the predicted features) equal the training forward over the same slots,
    at several context lengths reached through the cache (steps of 1, 2 and 5 tokens)."""
    model, tokenizer, _ = stories
    parts = TargetParts(model, 0)
    ids = tokenizer("Once upon a time there was a little dog who liked to run")["input_ids"]
    feats = _features(model, ids)
    runtime = FalconRuntime(falcon, parts, TreeConfig(depth=4, top_b=2, max_nodes=12))
    blocks = []
    inner = runtime._blocks

    def spy(frontier, pool, src, after, grand, *rest):
        inner(frontier, pool, src, after, grand, *rest)
        blocks.append([(pool[pool[n].parent].token, pool[n].token, src[pool[n].parent], src[n], after[n], grand[n])
                       for n in frontier if pool[n].depth == 2])

    runtime._blocks = spy
    verified = 6
    runtime.reset(ids[:verified], FeatureBatch(0, verified, {-1: feats[:verified]}))
    for pending in (verified, verified + 1, verified + 3, verified + 8):
        if pending > verified:
            runtime.commit(ids[verified:pending], FeatureBatch(verified, pending - verified, {-1: feats[verified:pending]}))
            verified = pending
        blocks.clear()
        runtime.propose(ids[: pending + 1], DraftLimits(max_depth=4, max_nodes=12), SamplingParams())
        root = pending - 2
        (a, b, fa, fb, after, grand), *_ = blocks[0]
        torch.testing.assert_close(fa, runtime.outputs[root])
        torch.testing.assert_close(fb, runtime.outputs[root + 1])
        # the training forward over slots 0 .. pending + 1: true features, then the predicted ones
        seq = ids[: pending + 1] + [a, b]
        inputs = torch.cat([feats[:pending], torch.stack([fa, fb])])[None]
        target = run_target_batch(model, make_batch([Example(seq, [1] * len(seq))]))
        out = falcon_forward_batch(falcon, parts, target, torch.float32, [pending % 2], inputs)[0]
        torch.testing.assert_close(out[root], fa, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out[root + 1], fb, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out[pending], after, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out[pending + 1], grand, atol=2e-5, rtol=1e-4)
    assert runtime.forwards > 0


def test_tree_needs_half_the_forwards(stories, falcon):
    """A depth-5 tree: the root block, then one forward for depths 3-4 and one for depth 5."""
    model, tokenizer, _ = stories
    ids = tokenizer("Once upon a time there was a little dog")["input_ids"]
    runtime = FalconRuntime(falcon, TargetParts(model, 0), TreeConfig(depth=5, top_b=3, max_nodes=60))
    runtime.reset(ids[:-1], FeatureBatch(0, len(ids) - 1, {-1: _features(model, ids[:-1])}))
    runtime.propose(ids, DraftLimits(max_depth=5, max_nodes=60), SamplingParams())  # caches the context slots
    before = runtime.forwards
    proposal = runtime.propose(ids, DraftLimits(max_depth=5, max_nodes=60), SamplingParams())
    assert runtime.forwards - before == 3  # root block, depth 2 -> 3/4, depth 4 -> 5
    assert max(proposal.tree.depths()) == 5 and len(proposal.tree.tokens) == 3 + 4 * 9  # top-3 frontier per depth


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)], ids=["greedy", "sampled"])
def test_decoding_with_falcon_is_exact(stories, falcon, sampling):
    """Greedy: the target's own tokens; sampled: seeded, see `check_seeded_sampling`."""
    model, tokenizer, model_id = stories
    prompt = tokenizer("Tom had a big red ball. He")["input_ids"]

    def generate(sampling):
        runtime = FalconRuntime(falcon, TargetParts(model, 0), TreeConfig(depth=4, top_b=3, max_nodes=10))
        return SpeculativeDecoder(LocalVerifier(TargetRunner(model, tokenizer, model_id)), runtime).generate(
            prompt, 40, sampling, stop_on_eos=False)

    if sampling.greedy:
        assert generate(sampling).tokens == reference_greedy(model, prompt, 40)
    else:
        check_seeded_sampling(generate, sampling)


def test_csgd_glances_more_when_pass_one_errs(stories, falcon):
    """Pass 2 keeps the target's features on more blocks the worse pass 1 predicted (a random
    drafter errs almost everywhere: almost every block is revealed at ratio 1, about half at 0.5)."""
    model, tokenizer, _ = stories
    ids = tokenizer("Once upon a time there was a little dog who liked to run in the park with his friends")["input_ids"]
    target = run_target_batch(model, make_batch([Example(ids, [1] * len(ids))]))
    parts = TargetParts(model, 0)
    seen = {}
    real = falcon_forward_batch

    def record(drafter, parts_, target_, dtype, offsets, feats=None):
        if feats is not None:
            seen["revealed"] = float((feats == target_.final[:, :-1]).all(-1).float().mean())
        return real(drafter, parts_, target_, dtype, offsets, feats)

    import splitspec.train.batched as batched

    batched.falcon_forward_batch, saved = record, batched.falcon_forward_batch
    try:
        shares = {}
        for glance in (1.0, 0.5):
            runs = []
            for seed in range(6):
                loss, metrics = falcon_loss_batch(falcon, parts, target, LossOptions(falcon_glance=glance), torch.float32,
                                                  random.Random(seed))
                assert torch.isfinite(loss) and metrics["rows"] == len(ids) - 3
                runs.append(seen["revealed"])
            shares[glance] = sum(runs) / len(runs)
    finally:
        batched.falcon_forward_batch = saved
    assert shares[1.0] > 0.9 and 0.25 < shares[0.5] < 0.75, shares


def test_spec_names_falcon():
    spec = DrafterSpec.parse("falcon;tree=4x2x8")
    assert spec.kind == "falcon" and spec.checkpoint("smollm2-135m").name == "falcon"
