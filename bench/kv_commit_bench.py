"""KV commit cost, side by side in one process: the previous commit (concatenate prefix + accepted
rows into new tensors) against `splitspec.shared.kv.keep_rows` (accepted rows copied in place, then
a crop), on a SmolLM2-135M-shaped cache (30 layers, 3 KV heads, head dim 64, fp32) with 25 tree
rows and a non-contiguous accepted path. Prints medians and their ratio per context length.

Run: `.venv/bin/python bench/kv_commit_bench.py`
"""
from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from splitspec.shared import kv

LAYERS, KV_HEADS, HEAD_DIM, TREE_ROWS = 30, 3, 64, 25
ACCEPTED = [0, 3, 7, 12]  # rows of the tree forward kept, not contiguous
REPEATS = 15


def _cache(prefix_len: int) -> DynamicCache:
    cache = DynamicCache()
    shape = (1, KV_HEADS, prefix_len + TREE_ROWS, HEAD_DIM)
    for layer in range(LAYERS):
        cache.update(torch.randn(shape), torch.randn(shape), layer)
    return cache


def concatenating_commit(cache: DynamicCache, prefix_len: int, rows: list[int]) -> None:
    """The commit before session 8: new tensors holding the prefix and the accepted rows."""
    index = torch.tensor(rows) + prefix_len
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[..., :prefix_len, :], layer.keys.index_select(-2, index)], dim=-2)
        layer.values = torch.cat([layer.values[..., :prefix_len, :], layer.values.index_select(-2, index)], dim=-2)


def _median_ms(commit, prefix_len: int) -> float:
    times = []
    for _ in range(REPEATS):
        cache = _cache(prefix_len)
        start = time.perf_counter()
        commit(cache, prefix_len, ACCEPTED)
        times.append(time.perf_counter() - start)
    return sorted(times)[REPEATS // 2] * 1e3


def main() -> None:
    torch.set_num_threads(2)
    before, after = _cache(500), _cache(500)
    for a, b in zip(before.layers, after.layers):
        b.keys.copy_(a.keys)
        b.values.copy_(a.values)
    concatenating_commit(before, 500, ACCEPTED)
    kv.keep_rows(after, 500, ACCEPTED)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in zip(before.layers, after.layers)), "the two commits disagree"
    print(f"KV commit, median of {REPEATS}, {LAYERS} layers x [1, {KV_HEADS}, T, {HEAD_DIM}] fp32, "
          f"{len(ACCEPTED)} of {TREE_ROWS} tree rows kept")
    in_place = {}
    for prefix_len in (300, 1000, 2000, 4000, 7000):
        old, new = _median_ms(concatenating_commit, prefix_len), _median_ms(kv.keep_rows, prefix_len)
        in_place[prefix_len] = new
        print(f"context {prefix_len:5d}: concatenate {old:7.2f} ms   in place {new:6.2f} ms   {old / new:5.1f}x")
    ratio = in_place[4000] / in_place[1000]
    print(f"Goal (issue 11): in-place commit at 4K context within 10% of 1K: {ratio:.2f}x -> "
          f"{'met' if abs(ratio - 1) <= 0.10 else 'missed'}")


if __name__ == "__main__":
    main()
