"""Ragged batched verification: several sessions' trees in one target forward, no padding, no copies.

The padded way to batch verify steps copies every session's KV prefix into one cache of B rows
padded to the longest (and transformers then concatenates the tree rows onto that copy and, for GQA
on a CPU, repeats the keys and values per query head): the copies grow with B x the longest
context, on every step, and on this project's CPU they made 8 batched steps cost 8x one.

The ragged way (the flattened batches of continuous-batching engines, vLLM / TGI): the trees of all
sessions are laid end to end as one sequence [1, N1 + N2 + ...] for every matmul (weights are
read once for all of them), and only attention is done per session, against that session's own
cache. `RaggedCache` stands in for the cache during the forward: each layer's new keys and values
are split by session and appended in place to the sessions' preallocated caches (shared/kv.py),
and what it hands the attention function is a `RaggedKV` (those caches' views, the row counts and
each session's tree mask for the layer's kind), which `ragged_attention` scores session by session
with SDPA (grouped-query heads without repeating the keys on a CPU). Everything else in the model
(projections, norms, MLPs, rotary at explicit positions, the LM head) is transformers' own.

`ragged_attention` is registered with transformers as the attention implementation `RAGGED`; for
ordinary tensors it is transformers' SDPA attention, except that a masked multi-row forward (a
tree) on a CPU with grouped keys passes SDPA `enable_gqa` instead of repeating the keys per query
head (`CPU_MASKED_GQA`: the same function, rounding differences of ~1e-7, one verify step 6-11%
cheaper here). A model switched to it (`enable`, which `TargetRunner` calls on the model it is
given, so other users of that model object go through it too) computes what it did before.
Only models whose attention is SDPA's semantics (no logit soft-capping, no attention sinks) are
switched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

RAGGED = "splitspec_ragged"
CPU_MASKED_GQA = True  # masked multi-row attention on a CPU with grouped keys: SDPA's enable_gqa, not repeat_kv


@dataclass(frozen=True)
class RaggedKV:
    """One layer's keys (or values) of a ragged forward: per session [1, Hkv, T_b, D] (views of
    its cache, the new rows included), the session's new rows n_b, and its additive mask
    [1, 1, n_b, T_b] for this layer."""

    tensors: list[torch.Tensor]
    rows: list[int]
    masks: list[torch.Tensor]


class RaggedCache(DynamicCache):
    """The cache of a ragged forward over `caches` (one per session, in order), which take
    `rows[b]` new positions each; `masks[kind][b]` is session b's mask for the layers of `kind`
    (`layer_kinds[layer]`). Nothing is stored here: every update goes to the sessions' caches."""

    def __init__(self, caches: list, rows: list[int], masks: dict[str, list[torch.Tensor]],
                 layer_kinds: list[str]) -> None:
        Cache.__init__(self, layer_class_to_replicate=DynamicLayer)
        self.caches, self.rows, self.masks, self.layer_kinds = caches, rows, masks, layer_kinds

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[RaggedKV, RaggedKV]:
        """key/value states [1, Hkv, sum(rows), D] -> each session's whole keys and values."""
        keys, values = [], []
        for cache, k, v in zip(self.caches, key_states.split(self.rows, dim=2), value_states.split(self.rows, dim=2)):
            k_all, v_all = cache.update(k, v, layer_idx)
            keys.append(k_all)
            values.append(v_all)
        masks = self.masks[self.layer_kinds[layer_idx]]
        return RaggedKV(keys, self.rows, masks), RaggedKV(values, self.rows, masks)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Always raises TypeError: a ragged forward holds one length per session, so its callers
        pass explicit `position_ids` and masks."""
        raise TypeError("a ragged forward has no single sequence length; pass position_ids")


def ragged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature. `key` / `value` are `RaggedKV` in a ragged
    forward: query [1, H, N, D] is split by session and each part attends to its own cache under
    its own mask; returns ([1, N, H, D], None). Anything else goes to transformers' SDPA attention,
    but for a masked multi-row forward (a tree) on a CPU with grouped keys (`CPU_MASKED_GQA`)."""
    if not isinstance(key, RaggedKV):
        if CPU_MASKED_GQA and query.shape[1] > key.shape[1] and attention_mask is not None \
                and query.device.type == "cpu" and query.shape[2] > 1:
            return _masked_sdpa(query, key, value, attention_mask, dropout, scaling).transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    outputs = [_masked_sdpa(q, k, v, mask, dropout, scaling)
               for q, k, v, mask in zip(query.split(key.rows, dim=2), key.tensors, value.tensors, key.masks)]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _masked_sdpa(query, key, value, mask, dropout: float, scaling) -> torch.Tensor:
    """SDPA of query [B, H, n, D] over keys/values [B, Hkv, T, D] under an additive mask: grouped
    keys go to SDPA as they are on a CPU (`enable_gqa`), and are repeated per query head elsewhere,
    where GQA with a mask falls back to the math kernel. Returns [B, H, n, D]."""
    groups = query.shape[1] // key.shape[1]
    gqa = groups > 1 and query.device.type == "cpu"
    if groups > 1 and not gqa:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                          enable_gqa=gqa)


AttentionInterface.register(RAGGED, ragged_attention)
AttentionMaskInterface.register(RAGGED, sdpa_mask)


def enable(model) -> bool:
    """Switch `model` to `RAGGED` attention if it runs transformers' SDPA attention now (its output
    is unchanged outside ragged forwards); True if the model can be batched raggedly.

    What is checked: `config._attn_implementation` is "sdpa" and the config sets no
    `attn_logit_softcapping`; a model whose attention SDPA cannot express (sinks, soft-capping) is
    expected not to run SDPA in the first place. Mutates `model.config` in place."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation == RAGGED:
        return True
    if implementation != "sdpa" or getattr(model.config, "attn_logit_softcapping", None):
        return False
    try:
        model.set_attn_implementation(RAGGED)
    except (ValueError, ImportError):  # a model class that refuses custom attention
        return False
    return model.config._attn_implementation == RAGGED
