"""Operations on transformers' `DynamicCache` that speculative decoding needs.

Each cache layer holds keys and values shaped [B, Hkv, T, D]. After a tree forward the cache holds
prefix + tree rows; committing the accepted path keeps the prefix and the accepted rows, in path
order, and drops the rest (EAGLE, Li et al. 2024, "copy accepted KV to contiguous slots, then crop").
No recomputation: the kept entries are the ones the tree forward computed.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(config) -> DynamicCache:
    return DynamicCache(config=config)


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
    """Keep the first `length` positions (lengths read from `layer`; every filled layer is cut)."""
    current = cache_length(cache, layer)
    if length > current:
        raise ValueError(f"cannot truncate a cache of {current} positions to {length}")
    if length < current:
        cache.crop(length - current)


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
    for layer in _layers(cache):
        if not getattr(layer, "is_initialized", True):
            continue
        index = torch.tensor(rows, device=layer.keys.device) + prefix_len
        layer.keys = torch.cat([layer.keys[..., :prefix_len, :], layer.keys.index_select(-2, index)], dim=-2)
        layer.values = torch.cat([layer.values[..., :prefix_len, :], layer.values.index_select(-2, index)], dim=-2)


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
