"""The speculative loop, shared by split and single-device modes: propose -> verify -> accept -> commit.

The target (behind a `Verifier`) decides every token, so the output is the target's own: greedy
output equals target-only greedy decoding, sampled output follows the target's distribution.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from splitspec.shared.sampling import SamplingParams

from .drafters import DraftLimits, Drafter
from .verifier import CallStats, Verifier

# on_tokens(new_token_ids): called as tokens commit, for streaming
TokenCallback = Callable[[list[int]], None]


@dataclass
class GenerationStats:
    """Per-answer figures. tau = new tokens per target call (accepted + bonus), the papers' accept
    length; open and verify calls both count as target calls."""

    new_tokens: int = 0
    target_calls: int = 0
    draft_tokens: int = 0  # tree nodes sent
    elapsed_s: float = 0.0
    draft_ms: float = 0.0  # time spent in drafter.propose
    calls: list[CallStats] = field(default_factory=list)

    @property
    def tau(self) -> float:
        verify_calls = self.target_calls - 1
        return (self.new_tokens - 1) / verify_calls if verify_calls > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.calls)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self.calls)

    @property
    def server_ms(self) -> float:
        return sum(c.server_total_ms for c in self.calls)

    @property
    def rtt_ms(self) -> float:
        return sum(c.rtt_ms for c in self.calls)

    def as_dict(self) -> dict:
        rtts = [c.rtt_ms for c in self.calls[1:]] or [0.0]
        servers = [c.server_total_ms for c in self.calls[1:]] or [0.0]
        return {
            "new_tokens": self.new_tokens, "target_calls": self.target_calls, "tau": round(self.tau, 3),
            "draft_tokens": self.draft_tokens, "elapsed_s": round(self.elapsed_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 2), "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received, "draft_ms": round(self.draft_ms, 1),
            "verify_rtt_ms_median": round(statistics.median(rtts), 2),
            "verify_server_ms_median": round(statistics.median(servers), 2),
        }

    def summary(self) -> str:
        d = self.as_dict()
        return (f"[{d['new_tokens']} tokens, {d['target_calls']} target calls, tau {d['tau']:.2f}, "
                f"{d['tokens_per_s']:.1f} tok/s, sent {d['bytes_sent']} B, received {d['bytes_received']} B, "
                f"per call: server {d['verify_server_ms_median']:.1f} ms / round trip {d['verify_rtt_ms_median']:.1f} ms]")


@dataclass
class Generation:
    tokens: list[int]
    stats: GenerationStats
    stopped_by_eos: bool


class SpeculativeDecoder:
    """Runs the loop for one drafter against one verifier."""

    def __init__(self, verifier: Verifier, drafter: Drafter) -> None:
        self.verifier = verifier
        self.drafter = drafter

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 *, stop_on_eos: bool = True, on_tokens: TokenCallback | None = None) -> Generation:
        """Generate up to `max_new_tokens` tokens after `prompt_ids`.

        Returns:
            The new token ids (EOS included when it ended the answer) and the stats.
        Raises:
            ValueError: max_new_tokens < 1 or an empty prompt.
            grpc.RpcError: from a remote verifier.
        """
        if max_new_tokens < 1 or not prompt_ids:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        eos = set(self.verifier.info.eos_token_ids) if stop_on_eos else set()
        stats = GenerationStats()
        start = time.perf_counter()
        session, opened = self.verifier.open(list(prompt_ids), sampling, self.drafter.feature_request)
        try:
            self.drafter.reset(prompt_ids, opened.features)
            stats.calls.append(opened.stats)
            stats.target_calls = 1
            context = list(prompt_ids)
            out: list[int] = []
            done = self._commit(context, out, [opened.first_token], eos, max_new_tokens, on_tokens)
            while not done:
                limits = DraftLimits(max_depth=min(max_new_tokens - len(out) - 1, self.verifier.info.max_tree_depth),
                                     max_nodes=self.verifier.info.max_tree_nodes,
                                     max_support=self.verifier.info.max_draft_support)
                tic = time.perf_counter()
                proposal = self.drafter.propose(context, limits, sampling)
                stats.draft_ms += (time.perf_counter() - tic) * 1e3
                step = session.verify(proposal.tree, proposal.draft_probs)
                stats.calls.append(step.stats)
                stats.target_calls += 1
                stats.draft_tokens += proposal.tree.size
                self.drafter.commit(step.new_tokens, step.features)
                done = self._commit(context, out, list(step.new_tokens), eos, max_new_tokens, on_tokens)
        finally:
            session.close()
        stats.new_tokens = len(out)
        stats.elapsed_s = time.perf_counter() - start
        return Generation(out, stats, stopped_by_eos=bool(out) and out[-1] in eos)

    @staticmethod
    def _commit(context: list[int], out: list[int], new: list[int], eos: set[int], budget: int,
                on_tokens: TokenCallback | None) -> bool:
        """Append committed tokens, cut at EOS or the budget; True when generation is over."""
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        new = new[: min(cut, budget - len(out))]
        context.extend(new)
        out.extend(new)
        if on_tokens and new:
            on_tokens(new)
        return len(out) >= budget or (bool(new) and new[-1] in eos)
