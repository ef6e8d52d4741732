"""The frequency-ranked draft vocabulary (FR-Spec): counting, ranking, the restricted LM head,
and drafts that stay inside it (losslessness with it is in test_drafters_moa)."""
from __future__ import annotations

import pytest
import torch

from splitspec.client.drafters.factory import make_drafter
from splitspec.client.drafters.base import DraftLimits
from splitspec.client.drafters.moa import MoARuntime
from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.draft_vocab import (DraftVocabMismatch, count_tokens, coverage, load_draft_vocab,
                                                   save_counts)
from splitspec.shared.drafters.moa import MoAConfig, MoADrafter
from splitspec.shared.drafters.target_parts import TargetParts
from splitspec.shared.models import tokenizer_fingerprint
from splitspec.shared.sampling import SamplingParams


def test_counts_rank_and_coverage(tmp_path):
    counts = count_tokens([([1, 2, 2, 3, 9], [0, 1, 1, 1, 1]), ([3, 3, 4], [1, 1, 0])], vocab_size=10)
    assert counts.tolist() == [0, 0, 2, 3, 0, 0, 0, 0, 0, 1]  # masked tokens (1, 4) are not counted
    save_counts(tmp_path / "c.safetensors", counts, "fp-a", "test")
    assert load_draft_vocab(tmp_path / "c.safetensors", 2, "fp-a").tolist() == [2, 3]
    # ties go to the smaller id; the result is sorted ascending
    assert load_draft_vocab(tmp_path / "c.safetensors", 4, "fp-a").tolist() == [0, 2, 3, 9]
    assert load_draft_vocab(tmp_path / "c.safetensors", 99, "fp-a").numel() == 10
    assert coverage(counts, torch.tensor([2, 3])) == pytest.approx(5 / 6)
    with pytest.raises(DraftVocabMismatch):
        load_draft_vocab(tmp_path / "c.safetensors", 2, "fp-b")
    with pytest.raises(ValueError):
        load_draft_vocab(tmp_path / "c.safetensors", 0, "fp-a")
    with pytest.raises(ValueError, match="outside"):
        count_tokens([([10], [1])], vocab_size=10)


def test_restricted_head(stories):
    model, _, _ = stories
    parts = TargetParts(model, 0)
    hidden = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([5, 17, 300])
    full = parts.head(hidden)
    parts.restrict_vocab(ids)
    kept = parts.head(hidden)
    assert kept.shape == full.shape
    # the LM head's rows for `ids`, in their places (the full product, and oneDNN's prepacked one
    # where the head is packed, round differently in the last bits)
    torch.testing.assert_close(kept[..., ids], torch.nn.functional.linear(hidden, model.lm_head.weight[ids]),
                               rtol=1e-5, atol=1e-5)
    others = torch.ones(full.shape[-1], dtype=torch.bool)
    others[ids] = False
    assert torch.isinf(kept[..., others]).all() and (kept[..., others] < 0).all()
    parts.restrict_vocab(None)
    assert torch.equal(parts.head(hidden), full)
    for bad in ([], [1, 1], [-1], [model.config.vocab_size]):
        with pytest.raises(ValueError):
            parts.restrict_vocab(torch.tensor(bad, dtype=torch.long))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_stay_inside_the_draft_vocabulary(stories, temperature):
    model, tokenizer, _ = stories
    torch.manual_seed(0)
    parts = TargetParts(model, 1)
    ids = torch.arange(0, model.config.vocab_size, 7)
    parts.restrict_vocab(ids)
    runtime = MoARuntime(MoADrafter(MoAConfig.from_target(model.config, tli=1)).eval(), parts,
                         TreeConfig(depth=3, top_b=3, max_nodes=10))
    prompt = tokenizer("Once upon a time")["input_ids"]
    from splitspec.server.runner import TargetRunner

    runner = TargetRunner(model, tokenizer, "stories")
    session, features, _ = runner.open(prompt, SamplingParams(), runtime.feature_request)
    runtime.reset(prompt, features)
    proposal = runtime.propose(prompt + [session.pending_token], DraftLimits(max_depth=3, max_nodes=10, max_support=64),
                               SamplingParams(temperature=temperature))
    allowed = set(ids.tolist())
    assert len(proposal.tree.tokens) == 10 and set(proposal.tree.tokens) <= allowed
    for row in proposal.draft_probs.values():
        assert set(row.token_ids.tolist()) <= allowed
    assert bool(proposal.draft_probs) == (temperature > 0)


def test_make_drafter_uses_the_targets_counts(stories, stories_path, tmp_path, monkeypatch):
    import splitspec.shared.drafters.shipped as shipped
    from splitspec.shared.drafters.spec import DEFAULT_DRAFT_VOCAB, DrafterSpec
    from splitspec.shared.drafters.checkpoint import TargetIdentity, save_checkpoint
    from splitspec.shared.drafters.draft_vocab import COUNTS
    from splitspec.shared.drafters.eagle import EagleConfig, EagleDrafter

    model, tokenizer, model_id = stories
    fingerprint = tokenizer_fingerprint(tokenizer)
    save_checkpoint(tmp_path / "eagle", "eagle2", EagleDrafter(EagleConfig.from_target(model.config)),
                    TargetIdentity.of(model, tokenizer, model_id), {})
    monkeypatch.setattr(shipped, "CHECKPOINTS", tmp_path / "shipped")

    def build(size):
        return make_drafter(DrafterSpec("eagle2", path=str(tmp_path / "eagle"), vocab=size),
                            target_fingerprint=fingerprint, target=str(stories_path), target_model=model)

    assert build(-1).parts.draft_vocab is None  # no counts shipped: the full vocabulary
    with pytest.raises(FileNotFoundError, match="token counts"):
        build(64)
    counts = torch.arange(model.config.vocab_size)  # token i seen i times
    save_counts(shipped.target_folder(str(stories_path)) / COUNTS, counts, fingerprint, "test")
    assert build(64).parts.draft_vocab.tolist() == list(range(model.config.vocab_size - 64, model.config.vocab_size))
    assert build(0).parts.draft_vocab is None
    assert build(-1).parts.draft_vocab.numel() == min(DEFAULT_DRAFT_VOCAB, model.config.vocab_size)


def test_a_negative_draft_vocabulary_names_the_flag_and_the_default():
    """-1 is the default (the shipped size), 0 the full vocabulary; below -1 the error says so."""
    from splitspec.shared.drafters.spec import DrafterSpec

    assert DrafterSpec.parse("moa", vocab=-1).vocab == -1 and DrafterSpec.parse("moa", vocab=0).vocab == 0
    with pytest.raises(ValueError, match=r"--draft-vocab.*-1 for the default; got -5"):
        DrafterSpec.parse("moa", vocab=-5)
