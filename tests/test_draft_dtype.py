"""Drafting in another dtype than the target's (`;dtype=` of a DrafterSpec, TargetParts(dtype=)):
the drafter's copies of the target's parts match the target's to the dtype's rounding, the target
itself is never touched (a single-device client shares it with the drafter), and decoding stays
exactly the target's."""
from __future__ import annotations

import pytest
import torch

from splitspec.client.drafters.factory import drafting_dtype, make_drafter
from splitspec.client.loop import SpeculativeDecoder
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.drafters.checkpoint import TargetIdentity, save_checkpoint
from splitspec.shared.drafters.eagle import EagleConfig, EagleDrafter
from splitspec.shared.drafters.moa import MoAConfig, MoADrafter
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.drafters.target_parts import TargetParts
from splitspec.shared.models import tokenizer_fingerprint

from .helpers import reference_greedy


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_bf16_parts_match_the_targets_and_leave_it_alone(stories):
    model, _, _ = stories
    before = _snapshot(model)
    fp32 = TargetParts(model, tli=1)
    bf16 = TargetParts(model, tli=1, dtype=torch.bfloat16)
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert bf16.layers[0] is not model.get_decoder().layers[-1] and fp32.layers[0] is model.get_decoder().layers[-1]
    ids = torch.tensor([[1, 5, 9, 200]])
    assert bf16.embed(ids).dtype == torch.bfloat16
    assert torch.equal(bf16.embed(ids), fp32.embed(ids).to(torch.bfloat16))  # rows cast, no table copied

    hidden = torch.randn(1, 4, model.config.hidden_size)
    positions = torch.arange(4)[None]
    mask = torch.triu(torch.full((4, 4), float("-inf")), 1)[None, None]
    want, _ = fp32.logits(hidden, positions, mask)
    got, _ = bf16.logits(hidden.to(torch.bfloat16), positions, mask.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, atol=0.05 * want.abs().max().item())
    assert (got.float().argmax(-1) == want.argmax(-1)).float().mean() >= 0.75

    ids = torch.tensor([3, 7, 11, 64])
    for parts in (fp32, bf16):
        parts.restrict_vocab(ids)
    kept_want, kept_got = fp32.head(hidden)[..., ids], bf16.head(hidden.to(torch.bfloat16))[..., ids]
    assert torch.allclose(kept_got.float(), kept_want, atol=0.05 * kept_want.abs().max().item())
    assert torch.isinf(bf16.head(hidden.to(torch.bfloat16))[..., 0]).all()

    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("kind", ["moa:tli=1", "moa", "eagle2"])
def test_a_bf16_drafter_beside_an_fp32_target_decodes_exactly(stories, stories_path, tmp_path, kind):
    """make_drafter with ;dtype=bfloat16 drafts in bf16 (module and parts) while the target stays
    in fp32; greedy output equals the target's own, and the target's weights are unchanged."""
    model, tokenizer, model_id = stories
    identity = TargetIdentity.of(model, tokenizer, model_id)
    torch.manual_seed(0)
    if kind.startswith("moa"):
        tli = 1 if kind.endswith("tli=1") else 0
        save_checkpoint(tmp_path / "ckpt", "moa", MoADrafter(MoAConfig.from_target(model.config, tli=tli)),
                        identity, {})
    else:
        save_checkpoint(tmp_path / "ckpt", "eagle2", EagleDrafter(EagleConfig.from_target(model.config)), identity, {})
    before = _snapshot(model)
    name = kind.partition(":")[0]
    spec = DrafterSpec.parse(f"{name}:{tmp_path / 'ckpt'};dtype=bfloat16;vocab=0;lookup=0")
    drafter = make_drafter(spec, target_fingerprint=tokenizer_fingerprint(tokenizer), target=str(stories_path),
                           target_model=model)
    assert drafter.dtype == torch.bfloat16 and next(drafter.module.parameters()).dtype == torch.bfloat16
    decoder = SpeculativeDecoder(LocalVerifier(TargetRunner(model, tokenizer, model_id)), drafter)
    prompt = tokenizer("Once upon a time")["input_ids"]
    out = decoder.generate(prompt, 24, stop_on_eos=False)
    assert out.tokens == reference_greedy(model, prompt, 24)
    assert out.stats.draft_tokens > 0  # it drafted (and the target checked every token)
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def test_drafting_dtype_auto_follows_the_measurement(stories, monkeypatch):
    from splitspec.client.drafters import factory

    model, _, _ = stories
    monkeypatch.setattr(factory, "fastest_dtype", lambda device: "bfloat16")
    assert drafting_dtype("auto", model) == torch.bfloat16
    assert drafting_dtype("float32", model) == torch.float32
    monkeypatch.setattr(factory, "fastest_dtype", lambda device: "float32")
    assert drafting_dtype("auto", model) == torch.float32
    assert drafting_dtype("bfloat16", model) == torch.bfloat16


def test_the_dtype_option_parses_and_refuses_unknown_dtypes():
    spec = DrafterSpec.parse("moa;dtype=float32")
    assert spec.dtype == "float32" and str(spec) == "moa;dtype=float32"
    assert DrafterSpec.parse("eagle2").dtype == "auto" and str(DrafterSpec.parse("eagle2")) == "eagle2"
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16"):
        DrafterSpec.parse("moa;dtype=fp16")


def test_the_cpus_dtype_choice_is_measured_once_and_kept(tmp_path, monkeypatch):
    """QA 57 gen finding 1: one timing per process, on a busy machine, sometimes chose fp32 over
    bf16, so a seeded sampled answer of a trained drafter did not repeat. The choice is now kept
    on disk per CPU model and torch version; a damaged file is measured again."""
    from splitspec.shared import models

    monkeypatch.setenv("SPLITSPEC_CACHE", str(tmp_path))
    timed = []
    monkeypatch.setattr(models, "_matmul_seconds",
                        lambda dtype, rounds=5: timed.append(dtype) or (1.0 if dtype == torch.bfloat16 else 2.0))
    models.fastest_dtype.cache_clear()
    try:
        assert models.fastest_dtype("cpu") == "bfloat16" and len(timed) == 2
        models.fastest_dtype.cache_clear()
        monkeypatch.setattr(models, "_matmul_seconds", lambda dtype, rounds=5: pytest.fail("measured again"))
        assert models.fastest_dtype("cpu") == "bfloat16"  # another process: read from the file
        (tmp_path / models.DTYPE_CHOICES).write_text("{not json")
        models.fastest_dtype.cache_clear()
        monkeypatch.setattr(models, "_matmul_seconds", lambda dtype, rounds=5: 1.0)  # no 1.25x gain
        assert models.fastest_dtype("cpu") == "float32"
    finally:
        models.fastest_dtype.cache_clear()
