"""`splitspec verify-cost`: what one verify step costs on this hardware, in fp32 and bf16, against
the memory-bandwidth floor of the weights, side by side in one run (issue 11).

Measured here, in one process:
- memory bandwidth: a large tensor copy (read + write), best of several;
- the floor of one step: the weights' bytes read once at that bandwidth;
- a verify forward after a `--context`-token prefix with 1, 5, 9, 25 positions (tree mask and
  position ids as the runner builds them; the prefix cache copied outside the timed region), per
  dtype, median of `--repeats`;
- how often greedy decoding through the verifier differs from the same dtype's plain
  `generate()` (bf16 rounding depends on matmul shapes, which a tree forward changes): answers to
  `--prompts` Spec-Bench prompts with the ngram drafter, and where they first differ.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
from transformers import DynamicCache

from splitspec.shared.models import encode_chat, load_model
from splitspec.shared.reference import target_greedy
from splitspec.shared.tree import DraftTree, tree_buffers

from .prompts import load_prompts

POSITIONS = (1, 5, 9, 25)


def copy_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes moved (read + write) per second by a tensor copy, best of `repeats`, in GB/s."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def step_ms(model, context: int, positions: int, repeats: int) -> float:
    """Median ms of a verify forward of `positions` rows (a chain tree) after `context` tokens."""
    vocab = model.config.vocab_size
    prefix = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (1, context)), past_key_values=prefix, use_cache=True)
        buffers = tree_buffers(DraftTree.chain(list(range(positions - 1))).parents)
        mask = buffers.attention_mask(context, next(model.parameters()).dtype)
        position_ids = buffers.position_ids(context)
        ids = torch.randint(0, vocab, (1, positions))
        times = []
        for _ in range(repeats + 1):
            cache = DynamicCache()
            for i, layer in enumerate(prefix.layers):
                cache.update(layer.keys.clone(), layer.values.clone(), i)
            start = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, use_cache=True, attention_mask=mask, position_ids=position_ids)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def greedy_mismatches(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> list[int | None]:
    """Per prompt: the first answer position where the verifier's greedy output differs from the
    same model's `generate()`, or None."""
    from splitspec.client.drafters import NgramDrafter
    from splitspec.client.loop import SpeculativeDecoder
    from splitspec.server.local import LocalVerifier
    from splitspec.server.runner import TargetRunner

    decoder = SpeculativeDecoder(LocalVerifier(TargetRunner(model, tokenizer, "target")), NgramDrafter())
    out = []
    for prompt in prompts:
        ref = target_greedy(model, prompt, new_tokens)
        got = decoder.generate(prompt, new_tokens, stop_on_eos=False).tokens
        out.append(next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None))
    return out


def cmd_verify_cost(args) -> None:
    torch.set_num_threads(args.threads)
    model32, tokenizer, model_id = load_model(args.target)
    dtypes = {"float32": model32, "bfloat16": load_model(args.target, dtype="bfloat16")[0]}
    bandwidth = copy_bandwidth_gbs()
    texts = load_prompts(["spec_bench"], 1, args.spec_bench)[: args.prompts]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p["text"]}]) for p in texts]
    lines = [f"target {model_id}, {args.threads} torch threads, context {args.context} tokens, median of "
             f"{args.repeats}; copy bandwidth {bandwidth:.1f} GB/s (read + write)", "",
             "| dtype | weights MB | floor ms | " + " | ".join(f"{n} pos ms" for n in POSITIONS)
             + " | 1 pos / floor | 25 pos / 1 pos | greedy answers differing from generate() |",
             "|---|---|---|" + "---|" * len(POSITIONS) + "---|---|---|"]
    goals = []
    for name, model in dtypes.items():
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        floor = weights / (bandwidth / 2 * 1e9) * 1e3  # read once at the copy's read rate
        times = {n: step_ms(model, args.context, n, args.repeats) for n in POSITIONS}
        print(f"{name}: " + ", ".join(f"{n} pos {t:.1f} ms" for n, t in times.items()), file=sys.stderr)
        diffs = greedy_mismatches(model, tokenizer, prompts, args.new_tokens)
        differ = [d for d in diffs if d is not None]
        where = f" (first at token {', '.join(map(str, differ))})" if differ else ""
        lines.append(f"| {name} | {weights / 1e6:.0f} | {floor:.1f} | "
                     + " | ".join(f"{times[n]:.1f}" for n in POSITIONS)
                     + f" | {times[1] / floor:.2f}x | {times[25] / times[1]:.2f}x | {len(differ)} of {len(diffs)}"
                     f"{where} |")
        goals.append(f"- {name}: 25-position verify / one-position step = {times[25] / times[1]:.2f}x (goal <= 1.3x: "
                     f"{'met' if times[25] / times[1] <= 1.3 else 'missed'}); one-position step / floor = "
                     f"{times[1] / floor:.2f}x (goal <= 2x: {'met' if times[1] / floor <= 2 else 'missed'})")
    print("\n".join(lines + ["", "Goals (issue 11):", *goals]))
