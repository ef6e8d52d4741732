"""`splitspec long-bench`: TokenSwift's setting (seed 003), answers thousands of tokens long.

For each output length, side by side in one process on one prompt (greedy, EOS off, so every arm
writes exactly that many tokens): the target's own `generate()`, speculative decoding with the
drafter, and both again under the contextual penalty (`--penalty`; the penalised target is then
its own baseline, since the penalty changes the answer). Reports seconds, tokens/s, the speed-up
over the matching `generate()`, the accept length tau and distinct-n (the share of n-grams of the
answer that are distinct: repetition lowers it), and checks that every speculative answer equals
its baseline's.
"""
from __future__ import annotations

import sys
import time

import torch

from splitspec.shared.models import encode_chat, load_model, tokenizer_fingerprint

from .out_paths import writable_file

DEFAULT_PROMPT = ("Write a long story about a lighthouse keeper who finds a message in a bottle, with many "
                  "chapters, characters and places.")


WARMUP_TOKENS = 16  # new tokens of the untimed warm-up answers


def distinct_n(tokens: list[int], n: int) -> float:
    """Distinct n-grams / all n-grams of `tokens` (1.0 for fewer than n tokens)."""
    grams = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def cmd_long_bench(args) -> None:
    """The long-bench command (module docstring); `args.lengths` is a list of new-token counts.

    Raises:
        ValueError, OSError: bad lengths, penalty settings, drafter or --out, before the model loads.
        SystemExit: a length past the target's context.
        RuntimeError: a speculative answer differed from its baseline's (after the table is printed
            and written, with a WARNING line naming the rows).
    """
    from splitspec.client.drafters.factory import make_drafter
    from splitspec.client.loop import SpeculativeDecoder
    from splitspec.server.local import LocalVerifier
    from splitspec.server.runner import TargetRunner
    from splitspec.shared.drafters.spec import DrafterSpec
    from splitspec.shared.reference import target_greedy
    from splitspec.shared.sampling import SamplingParams

    lengths = list(args.lengths)
    if not lengths or min(lengths) < 1 or len(set(lengths)) != len(lengths):
        raise ValueError(f"--lengths must be distinct counts >= 1, got {lengths}")
    penalties = [1.0] + ([args.penalty] if args.penalty != 1.0 else [])
    samplings = [SamplingParams(penalty=p, penalty_window=args.penalty_window) for p in penalties]  # checks both
    spec = DrafterSpec.parse(args.drafter)
    if args.out:
        writable_file(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, model_id = load_model(args.target)
    prompt = encode_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    room = int(getattr(model.config, "max_position_embeddings", 2048)) - len(prompt)
    if max(lengths) > room:
        raise SystemExit(f"--lengths: at most {room} new tokens fit the target's context after this prompt")
    drafter = make_drafter(spec, target_fingerprint=tokenizer_fingerprint(tokenizer),
                           target=args.target, target_model=model)
    decoder = SpeculativeDecoder(LocalVerifier(TargetRunner(model, tokenizer, model_id)), drafter)
    # a short warm-up of both methods first: the first calls pay one-time costs (allocations,
    # oneDNN primitives) that would otherwise land in the first row's generate() time
    target_greedy(model, prompt, WARMUP_TOKENS)
    decoder.generate(prompt, WARMUP_TOKENS, samplings[0], stop_on_eos=False)
    lossy = []  # (length, penalty) of speculative answers that differ from their baseline's
    lines = [f"target {model_id}, drafter {args.drafter}, {torch.get_num_threads()} torch threads, prompt of "
             f"{len(prompt)} tokens, greedy, EOS off", "",
             "| new tokens | penalty | method | seconds | tokens/s | vs generate() | tau | distinct-2 | distinct-3 "
             "| distinct-4 | exact |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for length in lengths:
        for penalty, sampling in zip(penalties, samplings):
            tic = time.perf_counter()
            reference = target_greedy(model, prompt, length, penalty=penalty, penalty_window=args.penalty_window)
            base_s = time.perf_counter() - tic
            tic = time.perf_counter()
            gen = decoder.generate(prompt, length, sampling, stop_on_eos=False)
            spec_s = time.perf_counter() - tic
            if gen.tokens != reference:
                lossy.append(f"{length} tokens, penalty {penalty:g}")
            for method, tokens, seconds, tau in (("generate()", reference, base_s, None),
                                                 (args.drafter, gen.tokens, spec_s, gen.stats.tau)):
                lines.append(f"| {length} | {penalty:g} | {method} | {seconds:.1f} | {len(tokens) / seconds:.1f} | "
                             f"{base_s / seconds:.2f}x | {'-' if tau is None else f'{tau:.2f}'} | "
                             + " | ".join(f"{distinct_n(tokens, n):.3f}" for n in (2, 3, 4))
                             + f" | {'-' if tau is None else gen.tokens == reference} |")
            print("\n".join(lines[-2:]), file=sys.stderr, flush=True)
            if args.out:  # rewritten after every pair, so that a long run cut short keeps its rows
                with open(args.out, "w") as f:
                    f.write("\n".join(lines) + "\n")
    if lossy:
        lines += ["", f"WARNING: {args.drafter}'s answer differs from generate()'s at {'; '.join(lossy)}: "
                      "speculative decoding was not lossless there"]
        print(lines[-1], file=sys.stderr)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if lossy:
        raise RuntimeError(f"long-bench: {len(lossy)} speculative answers differ from generate()'s (see the WARNING)")
