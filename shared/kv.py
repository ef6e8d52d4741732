"""Operations on transformers' `DynamicCache` that speculative decoding needs.

Each cache layer holds keys and values shaped [B, Hkv, T, D]. After a tree forward the cache holds
prefix + tree rows; committing the accepted path keeps the prefix and the accepted rows, in path
order, and drops the rest (EAGLE, Li et al. 2024, "copy accepted KV to contiguous slots, then crop"),
in place: the accepted rows are copied over the first tree rows and the cache is cropped.
No recomputation: the kept entries are the ones the tree forward computed.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache


class UnsupportedCache(ValueError):
    """The target's attention layers need a cache this module cannot commit trees into."""


FULL, SLIDING = "full_attention", "sliding_attention"


def attention_windows(config) -> dict[str, int | None]:
    """The model's attention layer kinds and their windows: {layer type: window in tokens, or
    None for full causal attention}.

    Models with `config.layer_types` (Qwen2/3, Gemma 2/3, ...) name a kind per layer; older ones
    (Mistral, Phi-3) apply `config.sliding_window`, when set, to every layer.

    Raises:
        UnsupportedCache: a layer kind other than full or sliding-window attention (chunked
            attention, linear attention, state-space layers): a tree's rejected rows cannot be
            dropped from such a layer's state by position.
    """
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or [SLIDING if window is not None else FULL])
    unknown = kinds - {FULL, SLIDING}
    if unknown:
        raise UnsupportedCache(f"{type(config).__name__} has {', '.join(sorted(unknown))} layers; splitspec's "
                               "verifier serves full and sliding-window attention only")
    if SLIDING in kinds and not window:
        raise UnsupportedCache(f"{type(config).__name__} has sliding-window layers but no sliding_window size")
    return {kind: (window if kind == SLIDING else None) for kind in sorted(kinds)}


def new_cache(config) -> DynamicCache:
    """An empty cache with full (growing) storage for every layer, sliding-window layers included.

    transformers' sliding-window cache layers keep only the last `window` positions, so the rows of
    a rejected branch cannot be dropped by position once the context is longer than the window;
    here every layer keeps every position and the window is applied by the attention mask instead
    (`TargetRunner` passes a windowed mask to sliding layers). Memory grows with the context on
    those layers too, as `cache_bytes` reports.
    """
    attention_windows(config)  # refuse what cannot be served before any state exists
    return DynamicCache()


def cache_length(cache: DynamicCache, layer: int = 0) -> int:
    """Number of cached positions (T) of `layer` (a cache may fill only some layers, e.g. TLI's)."""
    return cache.get_seq_length(layer)


def _layers(cache: DynamicCache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"{type(cache).__name__} has no per-layer storage; use DynamicCache")
    for layer in layers:
        if getattr(layer, "is_sliding", False):
            raise TypeError("sliding-window cache layers cannot be compacted by position")
    return layers


def truncate(cache: DynamicCache, length: int, layer: int = 0) -> None:
    """Keep the first `length` positions of every filled layer (a layer holding fewer keeps all;
    layers may differ, as SWIFT's skipped layers do).

    Raises:
        ValueError: `layer` holds fewer than `length` positions.
    """
    current = cache_length(cache, layer)
    if length > current:
        raise ValueError(f"cannot truncate a cache of {current} positions to {length}")
    for entry in _layers(cache):
        held = entry.get_seq_length() if getattr(entry, "is_initialized", True) else 0
        if held > length:
            entry.crop(length - held)


def keep_rows(cache: DynamicCache, prefix_len: int, rows: list[int]) -> None:
    """Keep positions [0, prefix_len) and then positions prefix_len + r for r in `rows`, in order.

    Raises:
        ValueError: a row lies outside the cached tree.
    """
    length = cache_length(cache)
    if any(not 0 <= r < length - prefix_len for r in rows):
        raise ValueError(f"rows {rows} outside the {length - prefix_len} cached tree rows")
    if rows == list(range(len(rows))):  # already contiguous: a crop is enough
        truncate(cache, prefix_len + len(rows))
        return
    index = None
    for layer in _layers(cache):
        if not getattr(layer, "is_initialized", True):
            continue
        if index is None or index.device != layer.keys.device:
            index = torch.tensor(rows, device=layer.keys.device) + prefix_len
        # in place: the accepted rows move right after the prefix (gathered first, as source and
        # destination may overlap), so the cost grows with the accepted rows, not the context
        for tensor in (layer.keys, layer.values):
            tensor[..., prefix_len: prefix_len + len(rows), :] = tensor.index_select(-2, index)
    truncate(cache, prefix_len + len(rows))


def layer_kv(cache: DynamicCache, layer: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer for positions [start, stop): each [Hkv, stop - start, D] (batch 0)."""
    entry = _layers(cache)[layer]
    return entry.keys[0, :, start:stop], entry.values[0, :, start:stop]


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes held by keys and values."""
    total = 0
    for layer in _layers(cache):
        if getattr(layer, "is_initialized", True) and layer.keys is not None:
            total += layer.keys.numel() * layer.keys.element_size() * 2
    return total
