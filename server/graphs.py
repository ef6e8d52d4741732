"""Verify forwards of fixed shape, replayed from CUDA graphs on a GPU.

On a GPU a verify step of a small target is bound by the host, not the device: session 26 timed
every step of SmolLM2-135M on an H100 at 20-45 ms, 85-126x the time its weights take to read,
because eager PyTorch launches each of a forward's ~500 kernels from Python. A CUDA graph records
the kernels of one forward once and replays them with one launch (the decode graphs of vLLM and
SGLang; gpt-fast's `torch.compile(mode="reduce-overhead")`). A graph fixes every shape and every
address, so a verify step is recast in fixed form (`StaticStep`):

- rows: the step's M query rows (pending/forced tokens and tree nodes) are padded to a bucket
  (1, 2, 4, ... `MAX_ROWS`); a padding row has token 0, attends only to itself, and is dropped;
- the cache: the session's preallocated storage (shared/kv.PreallocatedLayer, [1, Hkv, capacity, D]
  per layer) is written at positions held in a device tensor (`index_copy_`), and attention reads
  the whole storage under a mask [1, 1, rows, capacity] that hides every position the step may not
  see (past the step's rows, outside a tree path, outside a sliding window);
- inputs: ids, position ids, write positions and masks are copied into the step's own tensors
  before each replay; the logits and hidden states come back in the step's output tensors.

A `StaticStep` belongs to one session, one row bucket and one storage: when a session's storage
grows (every `PreallocatedLayer.CHUNK` positions) its steps are built again. The same steps run
eagerly on a CPU (no graph), which is how the tests check them against the ordinary verify.
Positions of the storage past the cached ones are zeroed when a storage is first used here: they are
multiplied by a mask, and uninitialised memory may hold NaN.

Memory: each captured step keeps its own outputs (logits [rows, V] and any hidden states) for as
long as its session lives; a session that used every bucket holds ~127 rows of logits (65 MB for a
128K vocabulary in fp32) besides its KV, which the server's KV budgets count (`held_bytes`). The
intermediate activations of all graphs share one pool.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from splitspec.shared import kv

MAX_ROWS = 64  # larger steps run eagerly


def bucket(rows: int) -> int | None:
    """The padded row count of a step of `rows` rows (the next power of two), or None above MAX_ROWS."""
    if rows < 1:
        raise ValueError(f"a verify step has at least one row, got {rows}")
    padded = 1 << (rows - 1).bit_length()
    return padded if padded <= MAX_ROWS else None


class _StorageCache(DynamicCache):
    """The cache a fixed-shape forward sees: each layer's new keys/values [1, Hkv, R, D] are written
    into the session's storage at `write` [R] (device positions), and attention gets the whole
    storage [1, Hkv, capacity, D]. Nothing is stored here."""

    def __init__(self, session_layers: list, write: torch.Tensor) -> None:
        Cache.__init__(self, layer_class_to_replicate=DynamicLayer)
        self.session_layers, self.write = session_layers, write

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.session_layers[layer_idx].write_at(self.write, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise TypeError("a fixed-shape forward has no sequence length; pass position_ids")


def storage_key(cache) -> tuple:
    """What identifies a session's storage for its graphs: every layer's buffer addresses and capacity."""
    return tuple((*(buffer.data_ptr() for buffer in layer.storage), layer.capacity) for layer in cache.layers)


class StaticStep:
    """One session's fixed-shape verify forward for `rows` padded rows over its current storage
    (see the module doc). `run` takes the step's real inputs and returns (logits [M, V], hidden
    states per layer [1, M, H] or None); on CUDA the forward is captured once and replayed."""

    def __init__(self, model, cache, rows: int, windows: dict, per_layer_type: bool, hidden: bool,
                 pool=None) -> None:
        self.model, self.rows, self.hidden = model, rows, hidden  # no reference to the cache: it holds the steps
        self.windows, self.per_layer_type = windows, per_layer_type
        first = cache.layers[0].storage[0]
        self.device, self.capacity = first.device, first.shape[-2]
        self.dtype = next(model.parameters()).dtype
        self.ids = torch.zeros(1, rows, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(1, rows, dtype=torch.long, device=self.device)
        self.write = torch.arange(rows, device=self.device)
        self.columns = torch.arange(self.capacity, device=self.device)
        self.masks = {kind: torch.zeros(1, 1, rows, self.capacity, dtype=self.dtype, device=self.device)
                      for kind in windows}
        self._cache = _StorageCache(list(cache.layers), self.write)
        self._pool = pool
        self.graph = None
        self._out = None

    @property
    def nbytes(self) -> int:
        """Device memory this step holds outside the shared graph pool: its fixed inputs and masks
        [1, 1, rows, capacity] per attention kind, and once captured its outputs (logits [1, rows, V]
        and hidden states [1, rows, H] per layer), which live until the session goes."""
        held = [self.ids, self.positions, self.write, self.columns, *self.masks.values()]
        if self._out is not None:
            logits, hidden = self._out
            held += [logits, *(hidden or ())]
        return sum(t.numel() * t.element_size() for t in held)

    def _forward(self):
        mask = self.masks if self.per_layer_type else next(iter(self.masks.values()))
        out = self.model(input_ids=self.ids, cache=self._cache, use_cache=True, attention_mask=mask,
                         position_ids=self.positions, output_hidden_states=self.hidden)
        return out.logits, (tuple(out.hidden_states) if self.hidden else None)

    def _load(self, prefix_len: int, row_ids: list[int], buffers) -> None:
        """Copy one step's inputs into the fixed tensors: M real rows, then padding."""
        m, lowest = len(row_ids), torch.finfo(self.dtype).min
        ids = torch.zeros(self.rows, dtype=torch.long)
        ids[:m] = torch.tensor(row_ids)
        positions = torch.full((self.rows,), prefix_len, dtype=torch.long)
        positions[:m] = buffers.position_ids(prefix_len)[0]
        self.ids.copy_(ids[None])
        self.positions.copy_(positions[None])
        self.write.copy_(torch.arange(prefix_len, prefix_len + self.rows))
        pad = torch.arange(m, self.rows, device=self.device)
        for kind, window in self.windows.items():
            # host work independent of the context: the tree block [M, M] is built on the host (a
            # window compares depths, so it is the same after any prefix), the prefix columns on the device
            mask = self.masks[kind]
            mask.fill_(lowest)
            mask[0, 0, :m, prefix_len: prefix_len + m] = buffers.attention_mask(0, self.dtype, "cpu", window)[0, 0]
            if window is None:
                mask[0, 0, :m, :prefix_len] = 0
            else:  # a row at position p sees the prefix keys at q > p - window
                seen = self.columns[None, :prefix_len] > (self.positions[0, :m, None] - window)
                mask[0, 0, :m, :prefix_len].masked_fill_(seen, 0)
            mask[0, 0, pad, prefix_len + pad] = 0  # a padding row sees itself only

    def run(self, prefix_len: int, row_ids: list[int], buffers):
        """Score one step: `row_ids` [M] at the storage's positions [prefix_len, prefix_len + M)
        under `buffers`' tree mask. Writes the rows' keys/values (and the padding's, past them) into
        the storage; the caller moves the cache's end (`commit_views`)."""
        self._load(prefix_len, row_ids, buffers)
        if self.device.type != "cuda":
            logits, hidden = self._forward()
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            logits, hidden = self._out
        m = len(row_ids)
        return logits[0, :m], (tuple(h[:, :m] for h in hidden) if hidden is not None else None)

    def _capture(self) -> None:
        current = torch.cuda.current_stream(self.device)
        # the outer context puts this thread back on its stream even when the capture fails
        # (`torch.cuda.graph` ends the capture before it restores the stream, with no `finally`)
        with torch.cuda.stream(current):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                self._forward()  # warm-up: library handles and workspaces are made outside the capture
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread-local: CUDA work of other threads (the service's) does not invalidate the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._out = self._forward()
        self.graph = graph


class StaticSteps:
    """The `StaticStep`s of the sessions of one target runner, built as sessions need them.

    `step(session_cache, rows, hidden)` returns the step for a verify of `rows` real rows, or None
    when it runs eagerly instead (more than MAX_ROWS rows). Steps are kept on the session's cache
    object (attribute `_static_steps`), so they go when the session goes. On CUDA the graphs of all
    sessions share one memory pool: the runner replays one at a time and reads its outputs before
    the next replay.
    """

    def __init__(self, model, windows: dict, per_layer_type: bool) -> None:
        """Raises:
            ValueError: a model whose forward reads tensors on the host, which a graph cannot
                capture (dynamic rotary scaling decides per call from the positions).
        """
        rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}
        kinds = rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]
        if any("dynamic" in str(kind.get("rope_type", kind.get("type", ""))) for kind in kinds):
            raise ValueError("CUDA graphs: dynamic rotary scaling chooses its frequencies on the host per call; "
                             "serve this target without --cuda-graphs")
        self.model, self.windows, self.per_layer_type = model, windows, per_layer_type
        device = next(model.parameters()).device
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.runs = 0  # fixed-shape steps run (the runner counts them)

    def step(self, cache, rows: int, hidden: bool) -> StaticStep | None:
        padded = bucket(rows)
        if padded is None or getattr(cache, "_static_off", False):
            return None
        layers = getattr(cache, "layers", None)
        if not layers or any(not isinstance(layer, kv.PreallocatedLayer) or not layer.is_initialized
                             for layer in layers):
            return None  # not a session cache (kv.new_cache) that every layer has written yet
        needed = kv.cache_length(cache) + padded
        for layer in layers:
            layer.reserve(needed)
        key = storage_key(cache)
        if getattr(cache, "_static_steps", (None,))[0] != key:
            clear_past(cache, layers[0].capacity)  # fresh storage: no NaN may hide in the masked positions
            cache._static_steps = (key, {})  # (the storage they were built for, {(rows, hidden): step})
        steps = cache._static_steps[1]
        if (padded, hidden) not in steps:
            steps[(padded, hidden)] = StaticStep(self.model, cache, padded, self.windows, self.per_layer_type,
                                                 hidden, self.pool)
        return steps[(padded, hidden)]


def session_steps(cache) -> list[StaticStep]:
    """The fixed-shape steps a session's cache holds now (those built for its current storage)."""
    held = getattr(cache, "_static_steps", None)
    return list(held[1].values()) if held is not None else []


def held_bytes(cache) -> int:
    """Bytes a session's fixed-shape steps hold (`StaticStep.nbytes` summed; 0 without steps). The
    graphs' intermediate activations live in the runner's one shared pool and are not counted here."""
    return sum(step.nbytes for step in session_steps(cache))


def forget(cache, eager: bool = False) -> None:
    """Drop a session's steps (and their graphs and outputs) now; `eager`: and let it build none
    again (`StaticSteps.step` returns None for it)."""
    if hasattr(cache, "_static_steps"):
        del cache._static_steps
    if eager:
        cache._static_off = True


def clear_past(cache, stop: int) -> None:
    """Zero the storage from the cached length up to `stop` (the end of the last padded step):
    the rows a step wrote and its commit dropped stay under the mask of later steps, and a mask
    adds a large negative number, which does not hide a NaN or inf in them (the eager forward
    never reads such rows again). One multi-tensor kernel for all layers."""
    length = kv.cache_length(cache)
    if stop > length:
        torch._foreach_zero_([buffer[..., length:stop, :] for layer in cache.layers
                              for buffer in layer.storage])


def commit_views(cache, length: int) -> None:
    """After a fixed-shape forward: the cache holds `length` positions (its views end there)."""
    for layer in cache.layers:
        layer.end_at(length)
