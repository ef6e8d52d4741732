"""Operations on transformers' `DynamicCache` that speculative decoding needs.

Each cache layer holds keys and values shaped [B, Hkv, T, D]. After a tree forward the cache holds
prefix + tree rows; committing the accepted path keeps the prefix and the accepted rows, in path
order, and drops the rest (EAGLE, Li et al. 2024, "copy accepted KV to contiguous slots, then crop"),
in place: the accepted rows are copied over the first tree rows and the cache is cropped.
No recomputation: the kept entries are the ones the tree forward computed.

A session's cache (`new_cache`) stores each layer in preallocated memory (`PreallocatedLayer`):
a forward's new rows are written after the cached ones instead of concatenated into new tensors,
so neither the append nor the commit of a verify step copies the context.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


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


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values live in preallocated storage.

    `keys` / `values` are views [B, Hkv, T, D] of buffers [B, Hkv, capacity, D]; `update` writes a
    forward's new rows into the buffers after the T cached ones (transformers' `DynamicLayer`
    concatenates, copying all T rows at every step), `crop` only moves the end, and `keep_rows`
    writes through the views. When the rows do not fit, the buffers grow to the next multiple of
    `CHUNK` positions with one copy: a copy of the context every `CHUNK` positions instead of at
    every step. Storage exceeds the cached positions by less than one chunk plus the rows the last
    forward appended and its commit dropped (the server's KV budgets count cached positions).
    """

    CHUNK = 256

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._key_buffer = key_states.new_empty(*key_states.shape[:-2], 0, key_states.shape[-1])
        self._value_buffer = value_states.new_empty(*value_states.shape[:-2], 0, value_states.shape[-1])
        self.keys, self.values = self._key_buffer, self._value_buffer  # the cached length is keys.shape[-2]
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return self._key_buffer.shape[-2] if self.is_initialized else 0

    def _grow(self, needed: int) -> None:
        capacity = -(-needed // self.CHUNK) * self.CHUNK
        length = self.keys.shape[-2]
        # both buffers are allocated before either replaces the old one: running out of memory
        # on the second leaves the layer as it was, not with two capacities
        grown = [old.new_empty(*old.shape[:-2], capacity, old.shape[-1])
                 for old in (self._key_buffer, self._value_buffer)]
        for name, new in zip(("_key_buffer", "_value_buffer"), grown):
            new[..., :length, :] = getattr(self, name)[..., :length, :]
            setattr(self, name, new)

    def reserve(self, positions: int) -> None:
        """Make the storage hold at least `positions` positions (server/graphs.py writes a padded
        step's rows past the cached ones); the cached rows keep their values."""
        if positions > self.capacity:
            self._grow(positions)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key/value states [B, Hkv, n, D]; returns all cached keys and values [B, Hkv, T + n, D].
        (`crop` and `get_seq_length` are `DynamicLayer`'s: they act on the views.)

        Raises:
            ValueError: states whose batch, heads or head size differ from the cached ones.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[:-2] != self._key_buffer.shape[:-2] or key_states.shape[-1] != self._key_buffer.shape[-1]:
            raise ValueError(f"key states {tuple(key_states.shape)} do not match the cache's "
                             f"{tuple(self._key_buffer.shape)} outside the position dimension")
        length, n = self.keys.shape[-2], key_states.shape[-2]
        if length + n > self.capacity:
            self._grow(length + n)
        self._key_buffer[..., length: length + n, :] = key_states
        self._value_buffer[..., length: length + n, :] = value_states
        self.end_at(length + n)
        return self.keys, self.values

    @property
    def storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value storage [B, Hkv, capacity, D] (the cached positions first; what
        lies past them is whatever a writer left there)."""
        return self._key_buffer, self._value_buffer

    def write_at(self, positions: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key/value states [B, Hkv, n, D] into the storage at `positions` [n] (int64, on the
        storage's device; each < `capacity`) without moving the cached length, and return the whole
        storage [B, Hkv, capacity, D]: a fixed-shape forward's cache update (server/graphs.py), which
        reads every storage position under its own mask and ends the views with `end_at`."""
        self._key_buffer.index_copy_(2, positions, key_states)
        self._value_buffer.index_copy_(2, positions, value_states)
        return self._key_buffer, self._value_buffer

    def end_at(self, length: int) -> None:
        """The layer holds the first `length` positions of its storage (`keys` / `values` end there);
        for writers that fill the storage directly (`update`, server/graphs.py)."""
        self.keys = self._key_buffer[..., :length, :]
        self.values = self._value_buffer[..., :length, :]

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a session cache holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a session cache holds one sequence")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a session cache holds one sequence")


class SessionCache(DynamicCache):
    """A `DynamicCache` whose layers are `PreallocatedLayer`s (created as the model first writes
    each layer, as `DynamicCache()` does)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=PreallocatedLayer)


def new_cache(config) -> DynamicCache:
    """An empty cache with full (growing, preallocated) storage for every layer, sliding-window
    layers included.

    transformers' sliding-window cache layers keep only the last `window` positions, so the rows of
    a rejected branch cannot be dropped by position once the context is longer than the window;
    here every layer keeps every position and the window is applied by the attention mask instead
    (`TargetRunner` passes a windowed mask to sliding layers). Memory grows with the context on
    those layers too, as `cache_bytes` reports.

    Raises:
        UnsupportedCache: a layer kind other than full or sliding-window attention (chunked, linear,
            state-space), or sliding layers without a window size.
    """
    attention_windows(config)  # refuse what cannot be served before any state exists
    return SessionCache()


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
        TypeError: a cache without per-layer storage, or with transformers' sliding-window layers
            (make session caches with `new_cache`).
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
        TypeError: a cache without per-layer storage, or with transformers' sliding-window layers
            (make session caches with `new_cache`).
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
    """Keys and values of one layer for positions [start, stop): each [Hkv, stop - start, D] (batch 0).

    Raises:
        TypeError: a cache without per-layer storage, or with transformers' sliding-window layers
            (make session caches with `new_cache`).
    """
    entry = _layers(cache)[layer]
    return entry.keys[0, :, start:stop], entry.values[0, :, start:stop]


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes of the cached positions' keys and values (a `PreallocatedLayer` holds less than one
    `CHUNK` of positions more).

    Raises:
        TypeError: a cache without per-layer storage, or with transformers' sliding-window layers
            (make session caches with `new_cache`).
    """
    total = 0
    for layer in _layers(cache):
        if getattr(layer, "is_initialized", True) and layer.keys is not None:
            total += layer.keys.numel() * layer.keys.element_size() * 2
    return total
