"""Where a CPU training step's time goes, against what its matmuls alone would take.

    python tools/train_floors.py [--tokens 8000] [--data data/smollm2-answers.jsonl]

Prints, for the SmolLM2-135M target and the moa + eagle2 pair in bf16 (batches of 4, max-len 512,
the train-bench settings), all side by side in one process:
- MoA's LSA forward + backward per 1,024 tokens with SDPA attention, with the eager attention the
  drafter uses, and compiled (`MoADrafter.compile_lsa`);
- ms per training token of the target's forward alone, target + moa, target + eagle2, target + both
  (the fast path's step, LSA compiled, the target eager);
- the bf16 GEMM rate of the step's shapes in isolation (TFLOP/s), the matmul floor those figures are
  compared with in docs/training.md, "Measuring training throughput".
Absolute times move between runs on a shared machine; compare within one run.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from splitspec.shared.drafters import moa as moa_module
from splitspec.shared.models import load_model
from splitspec.train.batched import LossOptions, make_batch, run_target_batch
from splitspec.train.objectives import EAGLE_NOISE
from splitspec.train.throughput import _trainees
from splitspec.train.trainer import TrainConfig, _vocab_ids, load_examples, trainee_loss


def lsa_ms(drafter, attention: str, compiled: bool, reps: int = 3) -> float:
    """ms of LSA fwd + bwd over 1,024 random tokens in bf16 autocast (the mean of `reps` after one warm-up)."""
    drafter.lsa.self_attn.config._attn_implementation = attention
    drafter._lsa_compiled = None
    if compiled:
        drafter.compile_lsa()
    x = torch.randn(1024, drafter.config.target_layers, drafter.config.kv_width)
    for i in range(reps + 1):
        if i == 1:
            tic = time.perf_counter()
        drafter.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = drafter.memory(x)
        out.float().square().mean().backward()
    return (time.perf_counter() - tic) / reps * 1e3


def gemm_tflops(m: int, k: int, n: int, reps: int = 50) -> float:
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    tic = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - tic) / 1e12


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--data", default="data/smollm2-answers.jsonl")
    args = p.parse_args()
    cfg = TrainConfig(drafter="moa,eagle2", target="smollm2-135m", out=Path("out/train-floors"), batch=4,
                      max_len=512, dtype="bfloat16", data=args.data, max_tokens=args.tokens)
    model, tokenizer, _ = load_model(cfg.target, dtype="bfloat16")
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}")

    torch.manual_seed(0)
    lsa = moa_module.MoADrafter(moa_module.MoAConfig.from_target(model.config)).train()
    for attention, compiled in (("sdpa", False), ("eager", False), ("eager", True)):
        print(f"LSA fwd + bwd per 1,024 tokens, {attention}{', compiled' if compiled else ''}: "
              f"{lsa_ms(lsa, attention, compiled):.0f} ms")

    examples, _ = load_examples(cfg, tokenizer)
    vocab = _vocab_ids(cfg, tokenizer)
    trainees = _trainees(cfg, cfg.jobs(), model, compile_lsa=True)
    ordered = sorted(examples, key=lambda e: len(e.input_ids))
    batches = [make_batch(ordered[i: i + cfg.batch]) for i in range(0, len(ordered), cfg.batch)]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    opts = LossOptions(vocab=vocab, eagle_noise=EAGLE_NOISE)

    def step(batch, names) -> None:
        with autocast:
            target = run_target_batch(model, batch, (), vocab)
        for t in trainees:
            if t.job.name in names:
                with autocast:
                    loss, _ = trainee_loss(cfg, t, target, opts, t.parts)
                t.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                t.optimizer.step()

    arms = ((), ("moa-tli0",), ("eagle2",), ("moa-tli0", "eagle2"))
    step(batches[0], arms[-1])  # compiles LSA before any clock starts
    tokens = sum(b.tokens for b in batches)
    for arm in arms:
        tic = time.perf_counter()
        for b in batches:
            step(b, arm)
        print(f"{' + '.join(('target',) + arm)}: {(time.perf_counter() - tic) / tokens * 1e3:.3f} ms per token "
              f"({tokens} tokens)")
    for shape in ((1920, 384, 768), (1920, 768, 384), (1234, 576, 1536), (4096, 576, 576)):
        print(f"bf16 GEMM {shape[0]}x{shape[1]} @ {shape[1]}x{shape[2]}: {gemm_tflops(*shape):.2f} TFLOP/s")


if __name__ == "__main__":
    main()
