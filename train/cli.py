"""The training room's commands: `train`, `train-bench`, `distill-data`, `draft-vocab`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from splitspec.shared.config import at_least
from splitspec.shared.models import DEFAULT_TARGET


def add_train_parsers(sub) -> None:
    _add_train_parser(sub)
    _add_train_bench_parser(sub)
    _add_distill_parser(sub)
    _add_draft_vocab_parser(sub)
    add_curve_parser(sub)


POSITIVE, NONNEGATIVE = at_least(1, int), at_least(0, int)


def _chunk(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise argparse.ArgumentTypeError(f"expected MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high)


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True,
                   help="moa | moa:tli=N | moa:pool=learned (softmax layer weights in LSA, not the paper's mean; options join with ':') | eagle2 | falcon | tokenswift, or a comma list trained together on one target pass")
    p.add_argument("--tli", type=int, default=0, help="MoA Target Layer Inference for a single `moa`")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--data", default="sharegpt",
                   help="sharegpt, or JSONL files written by `splitspec distill-data` (comma-separated; their "
                        "examples are pooled and shuffled); FILE[START:END] takes a record range, e.g. "
                        "data/smollm2-answers.jsonl[2320:] for the records after the first 2,320")
    p.add_argument("--max-len", type=POSITIVE, default=512)
    p.add_argument("--batch", type=POSITIVE, default=8, help="conversations per optimizer step")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="conversations per target forward, gradients accumulated over a --batch (must divide it; "
                        "0 = the whole batch at once): a large batch in the memory of a small one")
    p.add_argument("--lr", type=at_least(0, strict=True, finite=True), default=1e-3)
    p.add_argument("--chunk", type=_chunk, default=(1, 4),
                   help="MoA chunk lengths MIN-MAX: drafting distances 0 .. MAX-1 from the last verified token "
                        "(default: 1-4)")
    p.add_argument("--staircase", type=at_least(0), default=0.5,
                   help="MoA: SA widens from the current chunk to fully causal over this share of the steps (0 = off)")
    p.add_argument("--no-tli-norm", action="store_true",
                   help="MoA TLI > 0: compare layer L-N's input raw instead of per-dimension scaled")
    p.add_argument("--kl-weight", type=at_least(0, finite=True), default=0.1,
                   help="weight of the token term (forward KL / CE against the target's softmax) beside the "
                        "SmoothL1 feature term(s); 0.1 is EAGLE's and the official MoA's. Held-out loss keeps 0.1")
    p.add_argument("--train-vocab", type=at_least(-1, int), default=-1,
                   help="KL over the N most frequent target tokens (the draft vocabulary); 0 = all; "
                        "default: 8192 where the target has shipped token counts")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="matmul dtype (bfloat16 = autocast; weights, loss and optimizer stay fp32); auto = bfloat16 "
                        "where it is measured faster on this machine (AMX-BF16 CPUs, GPUs), else float32")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile MoA's LSA block in training steps and, in bf16, the frozen target's forward "
                        "(on a plain-linear copy): 3.6x -> 4.4x the reference path on a 2-core AMX CPU; the first "
                        "step pays ~1-2 minutes of compiling; auto = on for a CPU with a C++ compiler, off on a GPU "
                        "(not measured there)")
    p.add_argument("--seed", type=int, default=0, help="initialisation, data order and chunk draws")
    p.add_argument("--split-seed", type=int, default=0,
                   help="which ShareGPT conversations are held out; distill-data files must have left out the "
                        "same ones (their --seed), so keep it at the files' seed whatever --seed is")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--init", default="",
                   help="start from trained weights: a checkpoint folder, or a folder of <drafter name>/ checkpoints "
                        "(e.g. client/checkpoints/smollm2-135m), plus comma-separated NAME=PATH entries naming one "
                        "drafter's checkpoint; only a named entry may start a MoA from a MoA of another TLI depth "
                        "(moa-tli1=client/checkpoints/smollm2-135m/moa-tli0); drafters without one start from scratch. "
                        "Give a lower --lr (about where the earlier run's schedule ended, e.g. 2e-4): a fresh warm-up "
                        "to 1e-3 first undoes part of what the weights learned (docs/training.md, session 10)")
    p.add_argument("--skip-tokens", type=NONNEGATIVE, default=0,
                   help="skip this many tokens of the shuffled data first (what the --init weights already saw)")


def _config(args, out: Path, **extra):
    from splitspec.train.trainer import TrainConfig

    return TrainConfig(drafter=args.drafter, target=args.target, out=out, tli=args.tli, max_len=args.max_len,
                       batch=args.batch, micro_batch=args.micro_batch, lr=args.lr, chunk_min=args.chunk[0],
                       chunk_max=args.chunk[1],
                       staircase=args.staircase, tli_norm=not args.no_tli_norm, kl_weight=args.kl_weight,
                       train_vocab=args.train_vocab, dtype=args.dtype, compile=args.compile, seed=args.seed, split_seed=args.split_seed,
                       device=args.device, data=args.data, init=args.init, skip_tokens=args.skip_tokens, **extra)


def _add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train MoA / EAGLE-2 / Falcon / TokenSwift drafters by distillation from the target")
    _add_recipe_args(p)
    p.add_argument("--max-tokens", type=POSITIVE, default=200_000, help="training tokens per epoch")
    p.add_argument("--epochs", type=POSITIVE, default=1)
    p.add_argument("--eval-every", type=int, default=50, help="optimizer steps between held-out evaluations (0 = only when the run stops)")
    p.add_argument("--max-minutes", type=at_least(0), default=0.0,
                   help="stop cleanly after this many minutes of training (0 = no limit), counted over all of a "
                        "run's sessions (a --resume continues the same budget); time paused with "
                        "SIGTSTP (kill -TSTP, Ctrl-Z) does not count; a first SIGINT or SIGTERM (Ctrl-C, kill PID) also "
                        "stops cleanly after the current step (a second one is not caught)")
    p.add_argument("--time-schedule", action="store_true",
                   help="the lr decay and MoA's staircase follow --max-minutes as well as the steps (whichever is "
                        "further along), so a run the clock stops has finished its schedule; for a machine of unknown "
                        "speed, with --epochs set high")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="run torch.profiler over this many steps after the first and write OUT/profile.txt (time "
                        "per step, operators per step, operators by self time; CUDA time on a GPU)")
    p.add_argument("--cudnn-attention", action="store_true",
                   help="CUDA: let SDPA use cuDNN's attention (left out by default: it builds a graph for every "
                        "new batch shape, host time that dominated an H100's step; trainer.attention_backends)")
    p.add_argument("--heldout", type=NONNEGATIVE, default=16,
                   help="held-out conversations (loss, top-1, memory gain; 0 = none, and no held-out figures)")
    p.add_argument("--eval-prompts", type=NONNEGATIVE, default=4, help="held-out prompts of the tau measurement")
    p.add_argument("--eval-new-tokens", type=POSITIVE, default=48, help="tokens generated per tau prompt")
    p.add_argument("--out", help="run folder (required unless --eval-only)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out exactly where it stopped; refused where --out holds no saved "
                        "run, another --drafter list, or a changed recipe (data, budget, --max-len, --batch, --lr, "
                        "seeds, --heldout, losses, --init: trainer.RESUME_KEYS); --device, --dtype, --compile, "
                        "--micro-batch, --max-minutes and the evaluation settings may change, and --epochs too "
                        "(extending the run: a warning, and the card says so)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in an --out that holds one, replacing its checkpoints (refused without)")
    p.add_argument("--eval-only", action="store_true",
                   help="measure the --init checkpoints on the held-out split (loss, top-1, memory gain, tau over "
                        "--eval-prompts prompts, at most --heldout) and print the records; trains and writes nothing")
    p.add_argument("--against", default="",
                   help="with --eval-only: measure these checkpoints too (the forms --init takes) on the same prompts "
                        "and add the differences, paired by prompt: tau, top-1 and loss, each with its 95%% bootstrap "
                        "interval")
    p.set_defaults(func=cmd_train)


def train_config(args):
    """The `TrainConfig` of a parsed `splitspec train` command line."""
    if not args.out and not args.eval_only:
        raise SystemExit("splitspec train: --out is required (unless --eval-only)")
    return _config(args, Path(args.out or "."), max_tokens=args.max_tokens, epochs=args.epochs,
                   eval_every=args.eval_every, max_minutes=args.max_minutes, resume=args.resume,
                   time_schedule=args.time_schedule, profile_steps=args.profile_steps, heldout=args.heldout,
                   overwrite=args.overwrite,
                   cudnn_attention=args.cudnn_attention,
                   eval_prompts=args.eval_prompts, eval_new_tokens=args.eval_new_tokens, eval_only=args.eval_only,
                   against=args.against)


def cmd_train(args) -> None:
    from splitspec.train.trainer import train

    print(json.dumps(train(train_config(args))))


def _add_train_bench_parser(sub) -> None:
    p = sub.add_parser("train-bench", help="training tokens/s per drafter: the reference path vs the fast path, "
                                           "side by side in one process")
    _add_recipe_args(p)
    p.add_argument("--tokens", type=POSITIVE, default=8_000, help="training tokens each path processes")
    p.set_defaults(func=cmd_train_bench)


def cmd_train_bench(args) -> None:
    import torch

    from splitspec.train.throughput import bench_throughput

    runs = bench_throughput(_config(args, Path("out/train-bench")), args.tokens)
    ref, fast = runs[:2]
    print(f"drafters: {', '.join(ref.drafters)}; {torch.get_num_threads()} threads; {args.device}")
    print("| path | tokens | seconds | tokens/s per drafter | / reference |\n|---|---|---|---|---|")
    for r in runs:
        print(f"| {r.path} | {r.tokens} | {r.seconds:.1f} | {r.tokens_per_s:.0f} | {r.tokens_per_s / ref.tokens_per_s:.2f}x |")
    print(f"fast / reference: {fast.tokens_per_s / ref.tokens_per_s:.1f}x tokens/s per drafter")


def _add_distill_parser(sub) -> None:
    p = sub.add_parser("distill-data", help="write the target's own answers to ShareGPT prompts (token ids, JSONL)")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--out", required=True, help="JSONL file (appended to; resumable; plain, not .gz / .xz)")
    p.add_argument("--limit", type=POSITIVE, default=1000,
                   help="prompts to answer (a larger --limit on an existing file appends; a last batch an earlier "
                        "--limit cut short is answered again whole)")
    p.add_argument("--start", type=NONNEGATIVE, default=0,
                   help="skip the first START prompts (those another file already answers): --limit counts from "
                        "prompt 0, so --start 5000 --limit 8000 answers prompts 5,000-7,999")
    p.add_argument("--batch", type=POSITIVE, default=16)
    p.add_argument("--max-prompt-len", type=POSITIVE, default=256)
    p.add_argument("--min-prompt-len", type=NONNEGATIVE, default=0,
                   help="skip shorter prompts: e.g. 257 with --max-prompt-len 1024 gives the long-context prompts a "
                        "file written with the default 256 left out (train with a --max-len that holds them)")
    p.add_argument("--turns", default="first", choices=["first", "later", "middle"],
                   help="first: answer each conversation's first user turn; later: its deepest later user turn "
                        "whose history fits --max-prompt-len (multi-turn prompts); middle: every other later user "
                        "turn that fits (several per conversation, none that first or later answer)")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=256)
    p.add_argument("--temperature", type=at_least(0), default=0.0, help="0 = greedy (the drafters' main use)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--heldout", type=NONNEGATIVE, default=16, help="held-out conversations left out (as in `train`)")
    p.add_argument("--seed", type=int, default=0,
                   help="the held-out split's seed (train's --split-seed) and the sampling seed")
    p.add_argument("--sample-seed", type=int, default=None,
                   help="another sampling seed, the split kept (with --temperature: more answers to the same prompts)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--cache", default="dynamic", choices=["dynamic", "static"],
                   help="static: one preallocated cache for the longest prompt and answer; on a GPU transformers "
                        "then compiles the decoding step (recorded in the file's header)")
    p.set_defaults(func=cmd_distill)


def cmd_distill(args) -> None:
    from splitspec.train.distill import DistillConfig, distill_data

    cfg = DistillConfig(target=args.target, out=Path(args.out), limit=args.limit, batch=args.batch,
                        max_prompt_len=args.max_prompt_len, min_prompt_len=args.min_prompt_len,
                        max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, heldout=args.heldout, seed=args.seed,
                        dtype=args.dtype, device=args.device, turns=args.turns, start=args.start,
                        cache=args.cache, sample_seed=args.sample_seed)
    print(json.dumps(distill_data(cfg)))


def _add_draft_vocab_parser(sub) -> None:
    p = sub.add_parser("draft-vocab", help="count the target's tokens in ShareGPT responses for the draft vocabulary")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--data", default="sharegpt", choices=["sharegpt"])
    p.add_argument("--max-len", type=POSITIVE, default=2048, help="tokens counted per conversation")
    p.add_argument("--limit", type=POSITIVE, default=None, help="count only this many training conversations")
    p.add_argument("--heldout", type=NONNEGATIVE, default=16, help="held-out conversations left out of the counts (as train's)")
    p.add_argument("--split-seed", type=int, default=0, help="which conversations are held out (as train's)")
    p.add_argument("--out", default=None, help="default: client/checkpoints/<target>/token_counts.safetensors")
    p.set_defaults(func=cmd_draft_vocab)


def cmd_draft_vocab(args) -> None:
    from splitspec.shared.drafters.shipped import target_folder
    from splitspec.shared.drafters.draft_vocab import COUNTS
    from splitspec.train.vocab import make_counts

    out = Path(args.out) if args.out else target_folder(args.target) / COUNTS
    result = make_counts(args.target, out, heldout=args.heldout, split_seed=args.split_seed,
                         max_len=args.max_len, limit=args.limit)
    print(json.dumps({"out": str(out), **result}))


def add_curve_parser(sub) -> None:
    p = sub.add_parser("train-curve", help="learning curve of training runs: Markdown table (+ PNG)")
    p.add_argument("runs", nargs="+", help="training output directories")
    # no default file: one relative to the working folder overwrote the repo's tracked plot when run
    # from its root, and failed elsewhere before the table was printed (QA 56)
    p.add_argument("--png", default=None, help="also plot the curve to this PNG file")
    p.set_defaults(func=cmd_curve)


def cmd_curve(args) -> None:
    from splitspec.train.curve import plot, read_histories, table

    histories = read_histories([Path(r) for r in args.runs])
    print(table(histories))
    if args.png:
        plot(histories, Path(args.png))
