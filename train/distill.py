"""`splitspec distill-data`: the target's own answers to ShareGPT prompts, as training data.

A drafter is judged on the target's output, so training it on that output (rather than on the
ChatGPT answers in ShareGPT) usually raises acceptance (EAGLE §4.3 trains on fixed data but notes
the gain; Medusa-2 §3.3 "self-distillation"; HASS). For each training conversation (the held-out
split of `splitspec train` is left out) the target answers one user turn with batched generation:
with `turns="first"` the first turn alone; with `turns="later"` the deepest later user turn whose
whole history (ShareGPT's own earlier turns, answers included) fits `max_prompt_len`, which gives
multi-turn, longer-context prompts — conversations with one user turn are skipped; with
`turns="middle"` every later user turn that fits other than that deepest one (several prompts per
conversation, none that a "first" or "later" file with the same `max_prompt_len` answers). Prompts shorter
than `min_prompt_len` are skipped too, so a second file (say 257-1024 tokens) can hold the long
documents (summaries, retrieval) a first one with the default 256 left out. Each record is one JSON
line of token ids:

    {"index": i, "prompt_ids": [...], "answer_ids": [...]}

The first line of the file is a header with the settings (target, sampling, seed). Batches are
fixed ranges of prompt indices, each seeded with `sample_seed + first index` (`sample_seed` is
`seed`, the held-out split's, unless given: with a temperature, files that differ only in
`sample_seed` hold other answers to the same prompts, with the same conversations held out), and written whole, so a
run that stops can be resumed (the same command appends the missing batches) and gives the same
file as an uninterrupted one.

`cache="static"` generates into transformers' StaticCache, sized once for the longest prompt and
answer (`max_prompt_len + max_new_tokens`), instead of a cache that grows by concatenation every
step; on a GPU transformers then compiles the decoding step (`torch.compile`, CUDA graphs), meant
to cut the per-step overhead that bounds batched distillation there (a GPU's 7,000 answer tokens/s at
batch 384 in session 24 were ~55 ms a step for a 135M model; the static cache's speed is not yet
measured on a GPU). The answers equal the
dynamic cache's up to rounding (attention runs over the padded static length), and the header
records the cache so that a resumed file keeps one.
"""
from __future__ import annotations

import gzip
import json
import logging
import lzma
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .data import Example, sharegpt_split

log = logging.getLogger(__name__)
TURNS = ("first", "later", "middle")
CACHES = ("dynamic", "static")

@dataclass(frozen=True)
class DistillConfig:
    target: str
    out: Path
    limit: int = 1000  # prompts
    batch: int = 16
    max_prompt_len: int = 256
    min_prompt_len: int = 0  # e.g. 257 with a longer max_prompt_len: only the prompts a 256 file left out
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    heldout: int = 16
    seed: int = 0  # the held-out split's seed (train's --split-seed) and the sampling seed
    sample_seed: int | None = None  # the sampling seed where it is not `seed`
    dtype: str = "float32"
    device: str = "cpu"
    turns: str = "first"  # first | later | middle (see the module docstring)
    start: int = 0  # skip the first `start` prompts (the ones an earlier file already answers)
    cache: str = "dynamic"  # dynamic | static (see the module docstring)

    def __post_init__(self):
        if self.batch < 1 or self.limit < 1 or self.max_new_tokens < 1 or self.heldout < 0:
            raise ValueError(f"need batch, limit and max_new_tokens >= 1 and heldout >= 0, got batch {self.batch}, "
                             f"limit {self.limit}, max_new_tokens {self.max_new_tokens}, heldout {self.heldout}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if Path(self.out).suffix in COMPRESSED:
            raise ValueError(f"{self.out}: distill-data writes plain JSONL (it appends and resumes); give a .jsonl "
                             f"name and compress the finished file (gzip -k, xz -k)")
        if self.turns not in TURNS:
            raise ValueError(f"turns must be one of {TURNS}, not {self.turns!r}")
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, not {self.cache!r}")
        if not 0 <= self.start < self.limit:
            raise ValueError(f"need 0 <= start < limit, got start {self.start} and limit {self.limit}")
        if not 0 <= self.min_prompt_len <= self.max_prompt_len:
            raise ValueError(f"need 0 <= min_prompt_len <= max_prompt_len, got {self.min_prompt_len} and "
                             f"{self.max_prompt_len}")

    def header(self, model_id: str) -> dict:
        settings = {k: v for k, v in asdict(self).items() if k not in ("out", "limit")}  # a resume may extend
        if not self.start:
            del settings["start"]  # headers written before `start` existed stay valid
        if self.cache == "dynamic":
            del settings["cache"]  # as do those written before `cache` existed
        if self.sample_seed is None:
            del settings["sample_seed"]  # or `sample_seed`
        return {"splitspec_distill": 1, "model_id": model_id, **settings}


def _prompts(cfg: DistillConfig, tokenizer, conversations: list | None) -> list[list[int]]:
    from splitspec.shared.models import encode_chat

    train_convs, _ = sharegpt_split(cfg.heldout, cfg.seed, conversations)
    prompts = []
    for conv in train_convs:
        if cfg.turns == "first":
            found = [encode_chat(tokenizer, [conv[0]])]
        else:
            fitting = _later_turns(tokenizer, conv, cfg.max_prompt_len)
            found = fitting[-1:] if cfg.turns == "later" else fitting[:-1]
        prompts += [ids for ids in found if cfg.min_prompt_len <= len(ids) <= cfg.max_prompt_len]
        if len(prompts) >= cfg.limit:
            break
    return prompts[: cfg.limit]


def _later_turns(tokenizer, conv: list[dict], max_prompt_len: int) -> list[list[int]]:
    """The conversation up to each of its user turns after the first, in order, while the rendering
    fits `max_prompt_len` (rendered lengths grow with the turns, so the search stops at the first
    that does not fit). The last is the deepest that fits ("later"), the others "middle"."""
    from splitspec.shared.models import encode_chat

    fitting = []
    for k in range(1, len(conv)):
        if conv[k]["role"] != "user":
            continue
        ids = encode_chat(tokenizer, conv[: k + 1])
        if len(ids) > max_prompt_len:
            break
        fitting.append(ids)
    return fitting


def _done(path: Path, keep: int | None = None) -> int:
    """Records already written. A torn last line (from a killed run) is dropped, and with `keep` the
    records after the first `keep` too; the file is then rewritten through a temporary file and
    `os.replace`, so that a kill or a full disk during the rewrite leaves the old file whole."""
    if not path.exists():
        return 0
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    while lines and not lines[-1].endswith("\n"):
        lines.pop()
    for number, line in enumerate(lines[1:], start=2):  # extended as it is, `train` would refuse it later (QA 58)
        try:
            _record_ids(line)
        except ValueError:
            raise ValueError(f"{path} line {number}: not a distill-data record, so the file is damaged before its "
                             f"end: keep the records before it (head -n {number - 1}) or write another --out") from None
    if keep is not None:
        lines = lines[: 1 + keep]
    kept = "".join(lines)
    if kept != text:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(kept)
        os.replace(tmp, path)
    return max(0, len(lines) - 1)


@torch.no_grad()
def answer_batch(model, prompts: list[list[int]], cfg: DistillConfig, eos: list[int], pad: int,
                 seed: int) -> list[list[int]]:
    """Left-padded batched `generate`; each answer ends at (and includes) its first EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=cfg.device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=cfg.device)
    torch.manual_seed(seed)
    sample = cfg.temperature > 0
    # one static size for every batch, so that a compiled decoding step is compiled once
    static = dict(cache_implementation="static", max_cache_len=cfg.max_prompt_len + cfg.max_new_tokens) \
        if cfg.cache == "static" else {}
    out = model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=cfg.max_new_tokens,
                         do_sample=sample, temperature=cfg.temperature if sample else None,
                         top_p=cfg.top_p if sample else None, top_k=None, eos_token_id=eos, pad_token_id=pad,
                         **static)
    answers = []
    for row in out[:, width:].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        answers.append(row if end is None else row[: end + 1])
    return answers


# what a header without the key means (DistillConfig.header leaves these out at their defaults)
HEADER_DEFAULTS = {"start": 0, "cache": "dynamic", "sample_seed": None}


def settings_changed(written: dict, now: dict) -> str:
    """The settings of two headers that differ, as "key file's -> now; ...", keys in the file's order."""
    keys = list(written) + [k for k in now if k not in written]
    absent = object()

    def value(header: dict, key: str):
        return header.get(key, HEADER_DEFAULTS.get(key, absent))

    return "; ".join(f"{k} {'(none)' if value(written, k) is absent else value(written, k)} -> "
                     f"{'(none)' if value(now, k) is absent else value(now, k)}"
                     for k in keys if value(written, k) != value(now, k))


def distill_data(cfg: DistillConfig, conversations: list | None = None) -> dict:
    """Write (or complete) the JSONL file; returns counts.

    Raises:
        ValueError: the file is no distill-data file (`read_header`; it is left as it is) or was
            written with other settings.
    """
    from splitspec.shared.models import eos_token_ids, load_model

    model, tokenizer, model_id = load_model(cfg.target, device=cfg.device, dtype=cfg.dtype)
    header = cfg.header(model_id)
    if cfg.out.exists() and cfg.out.stat().st_size:
        first = read_header(cfg.out)  # before `_done` may trim the file
        first.setdefault("turns", "first")  # files written before `turns` existed
        first.setdefault("min_prompt_len", 0)  # or before `min_prompt_len`
        if first != header:
            raise ValueError(f"{cfg.out} was written with other settings ({settings_changed(first, header)}): "
                             "give the file's, or write another --out")
    done = _done(cfg.out)
    if not cfg.out.exists() or not cfg.out.stat().st_size:  # new, or only a torn header line
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(header) + "\n")
    prompts = _prompts(cfg, tokenizer, conversations)[cfg.start:]
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    start = done - done % cfg.batch
    if start != done and len(prompts) > done:
        # The last batch was cut short by the earlier run's --limit. Its answers came from a smaller
        # batch (other padding), so they are generated again as the whole batch an uninterrupted run
        # with this limit writes.
        done = _done(cfg.out, keep=start)
    tokens = 0
    with cfg.out.open("a") as f:
        for i in range(done, len(prompts), cfg.batch):
            chunk = prompts[i: i + cfg.batch]
            seed = cfg.seed if cfg.sample_seed is None else cfg.sample_seed
            answers = answer_batch(model, chunk, cfg, eos, pad, seed + cfg.start + i)
            f.write("".join(json.dumps({"index": cfg.start + i + k, "prompt_ids": p, "answer_ids": a}) + "\n"
                            for k, (p, a) in enumerate(zip(chunk, answers))))
            f.flush()
            tokens += sum(len(a) for a in answers)
    return {"out": str(cfg.out), "records": len(prompts), "first_index": cfg.start, "new_answer_tokens": tokens}


def parse_data_entry(entry: str) -> tuple[str, slice]:
    """A `--data` entry: a distill-data file, optionally with a record range in Python slice form,
    `data/answers.jsonl[2320:]` (records 2,320 to the end; records count from 0 in file order,
    which is their "index").

    Raises:
        ValueError: a range that is not `[START:END]` with optional non-negative integers.
    """
    if not entry.endswith("]") or "[" not in entry:
        return entry, slice(None)
    path, _, spec = entry[:-1].rpartition("[")
    bounds = spec.split(":")
    if len(bounds) != 2 or not all(b == "" or b.isdigit() for b in bounds):
        raise ValueError(f"--data entry {entry!r}: a record range is [START:END], e.g. {path}[2320:]")
    start, end = (int(b) if b else None for b in bounds)
    return path, slice(start, end)


COMPRESSED = {".gz": gzip.open, ".xz": lzma.open}  # suffix -> opener of a compressed distill-data copy


def open_data(path: str | Path):
    """A distill-data file for reading as text: plain JSONL, or its gzip (`*.jsonl.gz`, as the larger
    files are kept in data/) or xz copy (`*.jsonl.xz`, a third smaller: what tools/gpu_prepare.sh
    carries to a GPU machine, whose transfers hold 64 MiB)."""
    path = Path(path)
    opener = COMPRESSED.get(path.suffix)
    return opener(path, "rt") if opener else path.open()


def _read(path: str | Path, read=lambda f: f.read()) -> str:
    """`read(f)` of a distill-data file or of a compressed copy opened as text (`open_data`): the
    whole text by default.

    Raises:
        ValueError: it cannot be read or decoded (missing, a truncated or corrupt .gz / .xz copy).
    """
    try:
        with open_data(path) as f:
            return read(f)
    except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read it as a distill-data file ({err})") from None


def read_header(path: str | Path) -> dict:
    """The settings line (first line) of a distill-data file or of a compressed copy (`open_data`).

    Raises:
        ValueError: the file cannot be read, or its first line is no distill-data header.
    """
    line = _read(path, lambda f: f.readline())
    try:
        header = json.loads(line)
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or "splitspec_distill" not in header:
        raise ValueError(f"{path} line 1: not a distill-data header (is it a file `splitspec distill-data` wrote?)")
    return header


def same_model(made_by: str, model_id: str) -> bool:
    """Whether a distill-data header's `model_id` names the model `model_id` (what `load_model`
    returns): the same id, an alias and its upstream id (`tokenizer_source`), or two spellings of
    one local folder or file."""
    from splitspec.shared.models import tokenizer_source

    if made_by == model_id or tokenizer_source(made_by) == tokenizer_source(model_id):
        return True
    names = [name.partition("@") for name in (made_by, model_id)]
    return (names[0][1:] == names[1][1:] and all(Path(n[0]).exists() for n in names)
            and Path(names[0][0]).resolve() == Path(names[1][0]).resolve())


def check_target(path: str | Path, model_id: str) -> None:
    """Refuse a distill-data file that another model wrote: its token ids and answers are that
    model's, so a drafter of `model_id` would learn from another tokenizer's ids or another model's text.

    Raises:
        ValueError: the header names another model, or none.
    """
    header = read_header(path)
    if "model_id" not in header:
        raise ValueError(f"{path}: its header does not say which model wrote it; make it again with "
                         f"`splitspec distill-data`")
    if not same_model(header["model_id"], model_id):
        raise ValueError(f"{path} holds the answers of {header['model_id']} (distill-data --target "
                         f"{header.get('target', '?')}), not of this run's target {model_id}")


def check_heldout(path: str | Path, heldout: int, split_seed: int) -> None:
    """Refuse a distill-data file that may answer prompts of a training run's held-out split.

    `split_heldout` holds out the first `heldout` conversations of an order drawn from the seed, so
    a run's held-out conversations were left out of the file when it was distilled with the same
    seed and at least as many held out. Any other file can hold answers to the very prompts the
    run measures its held-out figures on.

    Raises:
        ValueError: the header names another split seed, fewer held-out conversations, or no split.
    """
    header = read_header(path)
    if "heldout" not in header or "seed" not in header:
        raise ValueError(f"{path}: its header does not say which conversations it held out; make it again "
                         f"with `splitspec distill-data`")
    if header["seed"] != split_seed or header["heldout"] < heldout:
        raise ValueError(f"{path} left out the {header['heldout']} held-out conversations of split seed "
                         f"{header['seed']}, but this run holds out {heldout} of split seed {split_seed}: "
                         f"its answers may include them. Train with --split-seed {header['seed']} and "
                         f"--heldout <= {header['heldout']}")


def load_distilled(path: str | Path, max_len: int, records: slice = slice(None),
                   vocab_size: int | None = None) -> list[Example]:
    """Examples (prompt + answer ids, loss on the answer) from the `records` of a distill-data
    file (or a compressed copy, `open_data`); the prompt, multi-turn history included, carries no loss.
    A torn last line (no newline: what a killed `distill-data` leaves) is skipped with a warning.

    Raises:
        ValueError: the file cannot be read, or a record (named by file and line) is no JSON object
            with lists of token ids `prompt_ids` and `answer_ids` (ids in [0, `vocab_size`) where given).
    """
    text = _read(path)
    lines = text.splitlines()
    if len(lines) > 1 and not text.endswith("\n") and not _parses(lines[-1]):
        log.warning("%s line %d: a torn last line (no newline), skipped", path, len(lines))
        lines.pop()
    bound = vocab_size or math.inf
    examples = []
    numbers = range(2, len(lines) + 1)[records]  # file line numbers, the header being line 1
    for number, line in zip(numbers, lines[1:][records]):
        try:
            prompt, answer = _record_ids(line)
        except ValueError as err:
            raise ValueError(f"{path} line {number}: not a distill-data record ({err})") from None
        ids = prompt + answer if isinstance(prompt, list) and isinstance(answer, list) else None
        if ids is None or not all(type(t) is int and 0 <= t < bound for t in ids):
            raise ValueError(f"{path} line {number}: prompt_ids and answer_ids must be lists of token ids"
                             + (f" in [0, {vocab_size}) (the target's vocabulary)" if vocab_size else ""))
        mask = ([0] * len(prompt) + [1] * len(answer))[:max_len]
        ids = ids[:max_len]
        if sum(mask) and len(ids) >= 8:
            examples.append(Example(ids, mask))
    return examples


def _record_ids(line: str) -> tuple:
    """(prompt_ids, answer_ids) of a record line, as written (`load_distilled` checks their values).

    Raises ValueError (its message: the parser's error, repr'd): not a JSON object holding both."""
    try:
        record = json.loads(line)
        return record["prompt_ids"], record["answer_ids"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(repr(err)) from None


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True
