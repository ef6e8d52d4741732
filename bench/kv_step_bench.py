"""KV storage per verify step, side by side in one process: transformers' `DynamicCache` (each
forward concatenates its new rows onto every layer's cached keys and values, copying the whole
context) against `splitspec.shared.kv.new_cache` (preallocated storage written in place), on the
target model: a verify step = a forward of a 5-node tree after the context plus the commit of a
3-node accepted path that skips a row (`kv.keep_rows`), repeated over consecutive steps, the two
caches alternating step by step. Prints the median step time per context length and the ratio.

Run: `.venv/bin/python bench/kv_step_bench.py [--target smollm2-135m] [--contexts 300,1000,4000]`
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from splitspec.shared import kv
from splitspec.shared.models import DEFAULT_TARGET, load_model
from splitspec.shared.tree import DraftTree, tree_buffers

TREE = DraftTree((11, 12, 13, 14, 15), (-1, 0, 0, 1, 3))  # 5 nodes; the path 0 -> 1 -> 3 skips row 2
ACCEPTED = [0, 1, 2, 4]  # forward rows kept: the pending token, nodes 0, 1, 3


def _step(model, cache, vocab: int) -> float:
    """One verify step on `cache` (forward + commit); returns its ms."""
    prefix = kv.cache_length(cache)
    buffers = tree_buffers(TREE.parents)  # the pending token is the root row
    ids = torch.tensor([[7, *TREE.tokens]]) % vocab
    start = time.perf_counter()
    model(input_ids=ids, cache=cache, use_cache=True, attention_mask=buffers.attention_mask(prefix, model.dtype),
          position_ids=buffers.position_ids(prefix))
    kv.keep_rows(cache, prefix, ACCEPTED)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--contexts", default="300,1000,4000")
    parser.add_argument("--steps", type=int, default=12, help="consecutive steps timed per cache")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _, model_id = load_model(args.target)
    vocab = model.config.vocab_size
    print(f"{model_id} fp32, {args.threads} threads; median of {args.steps} consecutive verify steps "
          f"(5-node tree forward + 3-node commit) per cache, alternating\n")
    print("| context tokens | DynamicCache ms | preallocated ms | DynamicCache / preallocated |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for context in (int(c) for c in args.contexts.split(",")):
            prefill = DynamicCache()
            model(input_ids=torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)),
                  cache=prefill, use_cache=True)
            caches = {"dynamic": DynamicCache(), "preallocated": kv.new_cache(model.config)}
            for cache in caches.values():
                for i, layer in enumerate(prefill.layers):
                    cache.update(layer.keys.clone(), layer.values.clone(), i)
            times = {name: [] for name in caches}
            for _ in range(args.steps + 1):
                for name, cache in caches.items():
                    times[name].append(_step(model, cache, vocab))
            a, b = (statistics.median(times[n][1:]) for n in ("dynamic", "preallocated"))
            print(f"| {context} | {a:.1f} | {b:.1f} | {a / b:.2f}x |", flush=True)
            assert all(torch.equal(x.keys, y.keys) for x, y in zip(caches["dynamic"].layers, caches["preallocated"].layers))


if __name__ == "__main__":
    main()
