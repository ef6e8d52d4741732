"""`splitspec train-bench`: training throughput of the reference path against the fast path, side by
side in one process on the same conversations.

- reference (the trainer before the fast path): one conversation per forward, fp32, the target
  re-run for every drafter, the LM head over the full vocabulary at every trained position;
- fast (train/batched.py): length-bucketed batches, one target pass shared by every drafter,
  bf16 autocast matmuls (fp32 weights, loss and optimizer), the LM head over the training
  vocabulary, and with `--compile` on MoA's LSA and the bf16 target compiled (then the fast path
  with nothing compiled is measured too, as a third row).

Reported per drafter: training tokens per second (a drafter "sees" a token when it takes a
gradient step on it; drafters trained together share the wall time), and the ratio.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from .batched import LossOptions, make_batch, run_target_batch
from .data import Example
from .objectives import EAGLE_NOISE, chunk_starts, eagle_loss, moa_loss, run_target
from .trainer import (DrafterJob, TrainConfig, Trainee, _vocab_ids, build_drafter, check_data_targets,
                      compiles_target, load_examples, load_training_target, trainee_loss)


@dataclass
class Throughput:
    path: str
    drafters: list[str]
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Training tokens per second per drafter."""
        return self.tokens / self.seconds


def _trainees(cfg: TrainConfig, jobs: list[DrafterJob], model, compile_lsa: bool = False) -> list[Trainee]:
    from splitspec.shared.drafters.target_parts import TargetParts

    out = []
    for job in jobs:
        torch.manual_seed(cfg.seed)
        drafter = build_drafter(job, model.config, compile_lsa).to(cfg.device).train()
        opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95))
        out.append(Trainee(job, drafter, TargetParts(model, job.tli), TargetParts(model, job.tli), opt,
                           random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed), cfg.out))
    return out


def reference_pass(cfg: TrainConfig, trainees: list[Trainee], model, examples: list[Example]) -> Throughput:
    """The old trainer's inner loop: per drafter, per conversation, target forward + loss + backward."""
    tokens = sum(len(e.input_ids) for e in examples)
    tic = time.perf_counter()
    for t in trainees:
        for ex in examples:
            ids = torch.tensor(ex.input_ids, device=cfg.device)
            target = run_target(model, ids, ex.loss_mask)
            if t.job.kind == "moa":
                starts = chunk_starts(ex.loss_mask, t.rng.randint(cfg.chunk_min, cfg.chunk_max), t.rng)
                loss, _ = moa_loss(t.drafter, t.parts, target, starts.to(cfg.device))
            else:
                loss, _ = eagle_loss(t.drafter, t.parts, target, EAGLE_NOISE, t.gen)
            t.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            t.optimizer.step()
    return Throughput("reference", [t.job.name for t in trainees], tokens, time.perf_counter() - tic)


def fast_pass(cfg: TrainConfig, trainees: list[Trainee], model, examples: list[Example], vocab) -> Throughput:
    """The fast trainer's inner loop over `examples` in batches of cfg.batch."""
    autocast = torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16,
                              enabled=cfg.dtype == "bfloat16")
    layer_inputs = tuple(sorted({t.parts.first_tli_layer for t in trainees if t.job.tli}))
    tokens = 0
    tic = time.perf_counter()
    ordered = sorted(examples, key=lambda e: len(e.input_ids))
    for i in range(0, len(ordered), cfg.batch):
        batch = make_batch(ordered[i: i + cfg.batch], cfg.device)
        tokens += batch.tokens
        with autocast:
            target = run_target_batch(model, batch, layer_inputs, vocab)
        for t in trainees:
            opts = LossOptions(vocab=vocab, eagle_noise=EAGLE_NOISE, device_metrics=True)
            with autocast:
                loss, _ = trainee_loss(cfg, t, target, opts, t.parts)
            t.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            t.optimizer.step()
    return Throughput("fast", [t.job.name for t in trainees], tokens, time.perf_counter() - tic)


def bench_throughput(cfg: TrainConfig, tokens: int, warmup: int = 2) -> list[Throughput]:
    """Both paths on the same first `tokens` training tokens (after `warmup` examples): [reference,
    fast], plus the fast path with nothing compiled where `cfg.compile` is on."""
    from splitspec.shared.models import load_model

    model32, tokenizer, model_id = load_model(cfg.target, device=cfg.device)
    check_data_targets(cfg, model_id)
    model16 = load_model(cfg.target, device=cfg.device, dtype=cfg.dtype)[0] if cfg.dtype != "float32" else model32
    fast_model = load_training_target(cfg) if compiles_target(cfg) else model16
    examples, _ = load_examples(TrainConfig(**{**cfg.__dict__, "max_tokens": tokens}), tokenizer)
    jobs = cfg.jobs()
    vocab = _vocab_ids(cfg, tokenizer)
    reference = _trainees(cfg, jobs, model32)
    fast = _trainees(cfg, jobs, fast_model, compile_lsa=cfg.compile == "on")
    # the warm-ups run on the trainees measured next, so that what --compile compiles is compiled before
    # the clock starts (a whole batch, so the padded LSA chunk is the shape the measurement uses)
    reference_pass(cfg, reference, model32, examples[:warmup])
    fast_pass(cfg, fast, fast_model, examples[:max(warmup, cfg.batch)], vocab)
    runs = [reference_pass(cfg, reference, model32, examples), fast_pass(cfg, fast, fast_model, examples, vocab)]
    if cfg.compile == "on":  # what compiling is worth, side by side
        eager = _trainees(cfg, jobs, model16)
        fast_pass(cfg, eager, model16, examples[:warmup], vocab)
        runs.append(fast_pass(cfg, eager, model16, examples, vocab))
        runs[-1].path = "fast, not compiled"
    return runs
