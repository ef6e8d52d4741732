"""Sampling parameters and the warped distributions both sides sample from.

The target distribution at a position is softmax(logits / temperature) restricted to the top-k
tokens and then to the top-p nucleus (Holtzman et al. 2020), renormalised. Speculative decoding
is lossless with respect to exactly this distribution (seed 002, Leviathan et al. 2023, §2.3).

Numerical safety: a temperature below `MIN_TEMPERATURE` means greedy decoding, on the client and
on the server alike (both compare the float32 value the wire carries), and the softmax divides
max-subtracted logits (all <= 0) by the temperature, so no float the proto can carry makes the
distribution NaN or Inf.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


# Temperatures below this are greedy (vLLM uses the same 1e-5 cut-off, `_SAMPLING_EPS`). At T = 1e-5
# a logit gap of 1e-3 already weighs exp(-100) ~ 4e-44, below float32's smallest normal number, so
# the sampled distribution is one-hot up to exact ties; greedy gives that without the underflow.
MIN_TEMPERATURE = 1e-5


def as_float32(value: float) -> float:
    """`value` rounded to float32, the precision of the wire's SamplingParams (inf past its range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    """temperature: 0 (or anything below `MIN_TEMPERATURE`, compared in float32) means greedy
    decoding; top_p in (0, 1]; top_k == 0 disables top-k. penalty > 1: TokenSwift's contextual
    penalty over the last `penalty_window` tokens (`apply_contextual_penalty`), applied by the
    server to the target's logits before acceptance: an opt-in change of the target's
    distribution, so the output is exact for the penalised target, not the plain one.

    Raises:
        ValueError: a temperature that is negative, NaN or not finite in float32; top_p outside
            (0, 1]; a negative top_k; a seed outside [0, 2**64); a penalty below 1 or not finite;
            a window below 1.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    penalty: float = 1.0
    penalty_window: int = 1024

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and as_float32(self.temperature) < float("inf")):
            raise ValueError(f"temperature must be a finite float32 number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must lie in [0, 2**64), got {self.seed}")
        if not (1.0 <= self.penalty and as_float32(self.penalty) < float("inf")):
            raise ValueError(f"the contextual penalty must be a finite number >= 1, got {self.penalty}")
        if self.penalty_window < 1:
            raise ValueError(f"the penalty window must be >= 1 token, got {self.penalty_window}")

    def describe(self) -> str:
        """'greedy', or the warping settings in words ('temperature 0.7, top-p 0.9[, top-k K]')."""
        if self.greedy:
            return "greedy"
        return (f"temperature {self.temperature:g}, top-p {self.top_p:g}"
                + (f", top-k {self.top_k}" if self.top_k else ""))

    @property
    def penalized(self) -> bool:
        """True when the contextual penalty is on (compared as the float32 the wire carries)."""
        return as_float32(self.penalty) != 1.0

    @property
    def greedy(self) -> bool:
        """True for temperatures below MIN_TEMPERATURE, compared as the float32 the wire carries so
        that client and server always agree, and for top-k 1, whose distribution is all on the
        argmax: sampling it is greedy decoding, and taken as sampled it switched off what only
        greedy answers use (TokenSwift's n-gram chains, prompt lookup below the root: QA 57)."""
        return as_float32(self.temperature) < as_float32(MIN_TEMPERATURE) or self.top_k == 1

    @classmethod
    def from_pb(cls, msg) -> "SamplingParams":
        return cls(temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k, seed=msg.seed,
                   penalty=msg.contextual_penalty or 1.0, penalty_window=msg.penalty_window or 1024)

    def to_pb(self, pb_cls):
        return pb_cls(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                      contextual_penalty=self.penalty if self.penalized else 0.0,
                      penalty_window=self.penalty_window if self.penalized else 0)


def apply_contextual_penalty(logits: torch.Tensor, windows: Sequence[Sequence[int]], penalty: float) -> torch.Tensor:
    """TokenSwift's contextual penalty (seed 003 §2.4): the repetition penalty of CTRL (Keskar et
    al. 2019, §4.1) restricted to a window of recent tokens. For row r, every token id in
    `windows[r]` has its logit divided by `penalty` when positive and multiplied when negative.

    Args:
        logits: [R, V] float. windows: R token-id sequences (the last W tokens before each row's
            prediction). penalty: >= 1.
    Returns:
        A penalised copy [R, V].
    """
    out = logits.clone()
    for row, window in enumerate(windows):
        if not window:
            continue
        ids = torch.tensor(sorted(set(window)), dtype=torch.long, device=logits.device)
        values = out[row, ids]
        out[row, ids] = torch.where(values > 0, values / penalty, values * penalty)
    return out


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p.

    Safe for every temperature SamplingParams admits: the logits are shifted so that their maximum
    is 0 before dividing by the temperature, so the quotient is <= 0 and never overflows (a tiny
    temperature gives -inf to all but the maximal logits, and softmax of a row holding a 0 is
    well-defined).

    Args:
        logits: [..., V] any float dtype, finite.
    Returns:
        [..., V] float32 probabilities, each row summing to 1. Greedy params give one-hot argmax rows.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature  # <= 0, the maximum exactly 0
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from `probs` [V] (>= 0, finite, positive sum; need not be normalised)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


class Stream(enum.IntEnum):
    """The parties that draw random numbers for one answer; each gets its own stream.

    Lossless speculative sampling (seed 002, Leviathan et al. 2023, §2.3) assumes the draft is
    independent of the target's acceptance draws: seeding both with the user's seed would make the
    target's uniforms a replay of the drafter's.
    """

    TARGET = 0  # the server's session: the first token, acceptance uniforms, bonus / recovered tokens
    DRAFTER = 1  # the drafter: sampled draft trees, and so the text it writes alone while offline


def stream_seed(seed: int, stream: Stream, position: int | None = None) -> int:
    """A 63-bit seed for `stream`, derived from the user's `seed` by numpy's SeedSequence with the
    stream (and `position`, when given) as spawn key (what `SeedSequence(seed).spawn()` gives its
    children), so that the streams are independent and each is reproducible from `seed` alone.

    `position`: where the stream starts drawing in the answer's context (a target session: the
    length of the prompt it opens with). A session the client re-opens mid-answer (server restart,
    idle expiry) starts further on and so draws fresh uniforms; with the seed alone it would replay
    those that drew the answer's first tokens, correlating the two parts of the answer."""
    key = (int(stream),) if position is None else (int(stream), int(position))
    state = np.random.SeedSequence(seed, spawn_key=key).generate_state(1, np.uint64)
    return int(state[0]) >> 1


def make_generator(seed: int, stream: Stream, position: int | None = None) -> torch.Generator:
    """The torch generator of `stream` for the user's `seed` (see `stream_seed`)."""
    gen = torch.Generator()
    gen.manual_seed(stream_seed(seed, stream, position))
    return gen
