"""A frequency-ranked draft vocabulary (FR-Spec: Zhao et al. 2025, "FR-Spec: Accelerating
Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling", §3).

The drafter's LM head is the target's, [V, E]; on a CPU client its matrix product is most of a
drafting pass (SmolLM2: V = 49,152, E = 576; 3.6-5.3 ms for one row against 0.4 ms for 8,192 rows, on
this project's 2-core machine). Drafting only among the N tokens that are most frequent in the
training responses cuts that cost by V / N. Verification is untouched, so the output stays the
target's: a token outside the draft vocabulary is never proposed, and the target supplies it as
the bonus token when it is next (under sampling, the draft rows put no mass on it, which the
recursive rejection handles like any other zero-probability token).

The counts live beside the target's shipped checkpoints as `token_counts.safetensors`: one int64
count per token id, with the tokenizer's fingerprint and the counted data in the metadata.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from .checkpoint import save_tensors

COUNTS = "token_counts.safetensors"


class DraftVocabMismatch(ValueError):
    """The token counts were made with another tokenizer."""


def count_tokens(sequences: Iterable[tuple[list[int], list[int]]], vocab_size: int) -> torch.Tensor:
    """Count the tokens that carry a loss (mask 1) in (input_ids, loss_mask) pairs.

    Returns:
        counts [vocab_size] int64.
    Raises:
        ValueError: a token id outside [0, vocab_size).
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in sequences:
        kept = torch.tensor([t for t, m in zip(ids, mask) if m], dtype=torch.int64)
        if kept.numel() and (kept.min() < 0 or kept.max() >= vocab_size):
            raise ValueError(f"token id outside the vocabulary of {vocab_size}")
        counts += torch.bincount(kept, minlength=vocab_size)
    return counts


def check_counts_path(path: str | Path) -> None:
    """Refuse a counts path that names a folder (before any counting).

    Raises:
        ValueError: `path` is an existing folder.
    """
    if Path(path).is_dir():
        raise ValueError(f"{path} is a folder; name the counts file, e.g. {Path(path) / COUNTS}")


def save_counts(path: str | Path, counts: torch.Tensor, fingerprint: str, source: str) -> None:
    """Write counts [V] with the tokenizer fingerprint and a description of the counted data,
    atomically (a temp file renamed; removed again when the write fails).

    Raises:
        ValueError: `path` is a folder (`check_counts_path`).
    """
    path = Path(path)
    check_counts_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors({"counts": counts.to(torch.int64).contiguous()}, path,
                 {"tokenizer_fingerprint": fingerprint, "source": source, "tokens": str(int(counts.sum()))})


def load_draft_vocab(path: str | Path, size: int, fingerprint: str) -> torch.Tensor:
    """The `size` most frequent token ids (ties broken by the smaller id), ascending.

    Returns:
        ids [min(size, V)] int64, sorted ascending.
    Raises:
        FileNotFoundError: no counts file. DraftVocabMismatch: counted with another tokenizer.
        ValueError: size < 1; a file that is no counts file (truncated, damaged, another tensor).
    """
    from safetensors import SafetensorError

    if size < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            counts = f.get_tensor("counts")
    except SafetensorError as err:  # also raised for a missing "counts" tensor
        raise ValueError(f"draft vocabulary counts {path}: not a valid counts file ({err}); count again with "
                         "`splitspec draft-vocab`") from err
    if meta.get("tokenizer_fingerprint") != fingerprint:
        raise DraftVocabMismatch(f"{path} was counted with tokenizer {meta.get('tokenizer_fingerprint')}, "
                                 f"the target's is {fingerprint}")
    return top_tokens(counts, size)


def top_tokens(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` ids with the highest counts [V] (ties to the smaller id), ascending: [min(size, V)]."""
    order = torch.sort(-counts, stable=True).indices[: min(size, counts.numel())]  # stable: ties in id order
    return torch.sort(order).values


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of the counted tokens that fall inside the vocabulary `ids`."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0
