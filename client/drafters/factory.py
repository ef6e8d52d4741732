"""The one factory that builds a drafter from its `DrafterSpec` (shared/drafters/spec.py).

moa, eagle2, falcon and tokenswift draft among the target's `spec.vocab` most frequent tokens (FR-Spec; counts in
client/checkpoints/<target>/token_counts.safetensors, see shared/drafters/draft_vocab.py). `spec.lookup_depth` > 0 (the
default) wraps any drafter but none and ngram in `PromptLookupMerge` (client/drafters/ngram.py).
"""
from __future__ import annotations

import torch

from splitspec.shared.drafters.checkpoint import TargetIdentity, checkpoint_id, load_checkpoint
from splitspec.shared.drafters.draft_vocab import COUNTS, load_draft_vocab
from splitspec.shared.drafters.shipped import target_folder
from splitspec.shared.drafters.spec import DEFAULT_DRAFT_VOCAB, SELF_DRAFTING, DrafterSpec
from splitspec.shared.drafters.target_parts import TargetParts
from splitspec.shared.models import fastest_dtype, load_model, load_tokenizer, tokenizer_fingerprint
from splitspec.shared.packed_linear import pack_linears
from splitspec.v1 import verify_pb2 as pb

from .base import Drafter, NoDrafter
from .draft_model import DraftModelDrafter
from .eagle import EagleRuntime
from .falcon import FalconRuntime
from .tokenswift import TokenSwiftRuntime
from .moa import MoARuntime
from .ngram import NgramDrafter, PromptLookupMerge
from .swift import SwiftConfig, SwiftDrafter

FEATURE_QUANT = {"fp16": pb.QUANTIZATION_NONE, "int8": pb.QUANTIZATION_INT8, "fp8": pb.QUANTIZATION_FP8_E4M3}


class TokenizerMismatch(ValueError):
    """The drafter tokenizes differently from the target: its drafts would be meaningless."""


def make_drafter(spec: DrafterSpec, *, target_fingerprint: str, target: str | None = None, target_model=None,
                 device: str = "cpu", dtype: str = "float32", seed: int = 0) -> Drafter:
    """Build the drafter `spec` names.

    Args:
        target_fingerprint: the tokenizer fingerprint of the target the drafts are for.
        target / target_model: the target (name, and the loaded model if at hand) whose frozen
            parts the self-drafting drafters (moa, eagle2) reuse and whose layers swift skips;
            `target` also picks `auto`.
        device, dtype: where a draft-model drafter runs.
        seed: the user's seed; drafters draw from its Stream.DRAFTER stream (shared/sampling.py).
    Raises:
        ValueError: a trained drafter or swift without a target, or a checkpoint of another kind.
        TokenizerMismatch: a drafter whose tokenizer fingerprint differs from the target's.
        FileNotFoundError: spec.vocab > 0 for a target without token counts.
        CheckpointMismatch: a checkpoint trained for another target.
    """
    spec = spec.resolve(target)
    drafter = _make(spec, target_fingerprint=target_fingerprint, target=target, target_model=target_model,
                    device=device, dtype=dtype, seed=seed)
    return PromptLookupMerge(drafter, spec.lookup_depth) if spec.lookup_depth else drafter


def _make(spec: DrafterSpec, *, target_fingerprint: str, target: str | None, target_model, device: str, dtype: str,
          seed: int) -> Drafter:
    """The drafter `spec` names, without the prompt-lookup merge (see make_drafter)."""
    if spec.kind in SELF_DRAFTING:
        return _self_drafter(spec, target_fingerprint=target_fingerprint, target=target, target_model=target_model,
                             seed=seed)
    if spec.kind == "none":
        return NoDrafter()
    if spec.kind == "ngram":
        return NgramDrafter()
    if spec.kind == "swift":
        return _swift(spec, target_fingerprint=target_fingerprint, target=target, target_model=target_model, seed=seed)
    model, tokenizer, model_id = load_model(spec.model, device=device, dtype=dtype)
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint != target_fingerprint:
        raise TokenizerMismatch(f"drafter {model_id} tokenizer {fingerprint} differs from the target's "
                                f"{target_fingerprint}")
    drafter = DraftModelDrafter(model, spec.tree, seed=seed)
    drafter.name = spec.name
    return drafter


def _self_drafter(spec: DrafterSpec, *, target_fingerprint: str, target: str | None, target_model,
                  seed: int) -> Drafter:
    """A moa, eagle2, falcon or tokenswift runtime on the target's frozen parts (see make_drafter)."""
    if target is None:
        raise ValueError(f"{spec.kind} needs the target model (--target) for its embedding and LM head")
    path = spec.checkpoint(target)
    if target_model is None:
        target_model, tokenizer, model_id = load_model(target)
    else:
        tokenizer, model_id = load_tokenizer(target), target
    identity = TargetIdentity.of(target_model, tokenizer, model_id)
    if identity.tokenizer_fingerprint != target_fingerprint:
        raise TokenizerMismatch(f"{target} tokenizes differently from the server's target")
    dtype = drafting_dtype(spec.dtype, target_model)
    _, module, meta = load_checkpoint(path, identity, dtype=dtype)
    if meta["kind"] != spec.kind:
        raise ValueError(f"{path} holds a {meta['kind']} drafter, not {spec.kind}")
    if next(module.parameters()).device.type == "cpu":
        pack_linears(module)  # drafting runs the same few-row products a decode step does
    parts = TargetParts(target_model, module.config.tli if spec.kind == "moa" else 0, dtype=dtype)
    parts.restrict_vocab(draft_vocab_ids(target, spec.vocab, target_fingerprint))
    quantization = FEATURE_QUANT[spec.quant]
    if spec.kind == "eagle2":
        return EagleRuntime(module, parts, spec.tree, quantization=quantization, seed=seed)
    if spec.kind == "falcon":
        return FalconRuntime(module, parts, spec.tree, quantization=quantization, seed=seed)
    if spec.kind == "tokenswift":
        return TokenSwiftRuntime(module, parts, spec.tree, quantization=quantization, seed=seed)
    lsa_id = checkpoint_id(path) if spec.lsa == "server" else ""
    return MoARuntime(module, parts, spec.tree, lsa_placement=spec.lsa, lsa_id=lsa_id, quantization=quantization,
                      seed=seed)


def drafting_dtype(name: str, target_model) -> torch.dtype:
    """What a trained drafter computes in beside `target_model` (DrafterSpec.dtype): float32 or
    bfloat16 as named; `auto`: bf16 when the target is in fp32 on a device where a bf16 matmul of
    the drafters' shapes is measured at least 1.25x faster (shared/models.py `fastest_dtype`),
    else the target's own dtype. Only drafts depend on it: the target verifies every token.

    Drafting in bf16 on this project's 2-core AVX512-BF16 CPU (docs/benchmarks.md, "Session 27";
    side by side in one run, all answers exact): 56 Spec-Bench prompts single-device, moa 1.39x ->
    1.44x `generate()`, eagle2 1.54x -> 1.60x, tau 2.09 / 2.08 and 2.06 / 2.07; over 4g moa 1.39x
    -> 1.45x remote AR. A moa step proposed in 8.2-9.2 -> 6.4-6.6 ms.
    """
    own = target_model.get_output_embeddings().weight.dtype
    if name == "auto":
        device = target_model.get_output_embeddings().weight.device.type
        return torch.bfloat16 if own == torch.float32 and fastest_dtype(device) == "bfloat16" else own
    return getattr(torch, name)


def _swift(spec: DrafterSpec, *, target_fingerprint: str, target: str | None, target_model, seed: int) -> Drafter:
    """SWIFT over the target's own weights (shared with `target_model` when given, see make_drafter)."""
    if target is None and target_model is None:
        raise ValueError("swift drafts with the target's own layers: it needs the target model (--target)")
    if target_model is None:
        target_model, tokenizer, _ = load_model(target)
        if tokenizer_fingerprint(tokenizer) != target_fingerprint:
            raise TokenizerMismatch(f"{target} tokenizes differently from the server's target")
    config = SwiftConfig(seed=seed) if spec.ratio is None else SwiftConfig(ratio=spec.ratio, seed=seed)
    drafter = SwiftDrafter(target_model, config, quantization=FEATURE_QUANT[spec.quant])
    drafter.name = spec.name
    return drafter


def draft_vocab_ids(target: str, size: int, fingerprint: str):
    """Token ids [N] for TargetParts.restrict_vocab, or None for the full vocabulary.

    Raises:
        FileNotFoundError: size > 0 and no token counts ship for `target`.
    """
    counts = target_folder(target) / COUNTS
    if size == 0 or (size < 0 and not counts.exists()):
        return None
    if not counts.exists():
        raise FileNotFoundError(f"no token counts for {target} ({counts}); make them with `splitspec draft-vocab` "
                                "or pass --draft-vocab 0")
    return load_draft_vocab(counts, DEFAULT_DRAFT_VOCAB if size < 0 else size, fingerprint)
