"""The speculative loop, shared by split and single-device modes: propose -> verify -> accept -> commit.

The target (behind a `Verifier`) decides every token, so the output is the target's own: greedy
output equals target-only greedy decoding, sampled output follows the target's distribution.

Two things can make the client write tokens the target has not (yet) checked, and the stream marks
them (`StreamEvent.source`):
- offline continuation (seed 001, §4.4 disconnection experiment): when a Verify call fails or misses
  its deadline, the drafter goes on alone (with TLI > 0 the target's last layers run here) while a
  background thread probes the server with exponential backoff and full jitter. Back online, the
  call that failed is re-sent unchanged (same session id and step: the server answers a step it
  already ran from its record), the offline tokens are verified as chains (one call per
  `max_tree_depth` tokens) and, from the first token the target rejects, replaced by the target's
  continuation (`heal`) or kept as written (`keep`, sent as forced tokens). A lost session (server
  restart) is re-opened with the committed context. Each token is delivered once; later events only
  confirm, keep or retract it.
- private spans (client/privacy.py): tokens the drafter reproduces from private prompt text are
  written locally; the server sees placeholders.
"""
from __future__ import annotations

import logging
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from splitspec.shared.acceptance import SparseProbs
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import ROOT, DraftTree

from .drafters import DraftLimits, Drafter
from .privacy import PrivacyGuard, best_path
from splitspec.shared.verifier import CallStats, LinkDown, SessionLost, StepResult, Verifier

log = logging.getLogger(__name__)

# on_tokens(new_token_ids): called as tokens are appended to the answer (any source), for streaming
TokenCallback = Callable[[list[int]], None]

TARGET, OFFLINE, KEPT, PRIVATE = "target", "offline", "kept", "private"
_FORCED = (KEPT, PRIVATE)  # written by the client for good: sent as forced tokens, never verified


@dataclass(frozen=True)
class StreamEvent:
    """One change to the answer; positions index the answer's tokens (0 = the first new token).

    kind "tokens": `tokens` appended at `start`, written by `source`: "target" (verified),
      "offline" (the drafter alone, awaiting verification) or "private" (reproduced from a private
      span on this device; never sent).
    kind "verified": the `count` offline tokens from `start` on were accepted by the target.
    kind "kept": the `count` offline tokens from `start` on stay as written though the target
      disagrees from `start` on (--on-reconnect keep).
    kind "retract": every token from `start` on is withdrawn (the target rejected the first of them).
    """

    kind: str
    start: int
    tokens: tuple[int, ...] = ()
    source: str = TARGET
    count: int = 0


EventCallback = Callable[[StreamEvent], None]


@dataclass(frozen=True)
class OfflinePolicy:
    """What the loop does when the verify service is unreachable.

    enabled: continue with the drafter alone (else LinkDown propagates).
    on_reconnect: "heal" (text after the first rejected offline token is replaced by the target's
      continuation) or "keep" (it stays as written).
    backoff_*: reconnect probes wait min(max, initial * 2**attempt) * U(0, 1) s (full jitter).
    final_wait_s: how long to wait for the link when the answer is complete but unverified, or when
      the drafter cannot write alone (then LinkDown is raised).
    """

    enabled: bool = True
    on_reconnect: str = "heal"
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    final_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if self.on_reconnect not in ("heal", "keep"):
            raise ValueError(f"on_reconnect must be heal or keep, got {self.on_reconnect!r}")


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
    offline_tokens: int = 0  # written by the drafter alone while the link was down
    private_tokens: int = 0  # reproduced from private spans on this device
    retracted_tokens: int = 0  # offline tokens withdrawn after the target rejected them (heal)
    disconnects: int = 0
    reopened_sessions: int = 0

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
            "offline_tokens": self.offline_tokens, "private_tokens": self.private_tokens,
            "retracted_tokens": self.retracted_tokens, "disconnects": self.disconnects,
            "reopened_sessions": self.reopened_sessions,
        }

    def summary(self) -> str:
        d = self.as_dict()
        return (f"[{d['new_tokens']} tokens, {d['target_calls']} target calls, tau {d['tau']:.2f}, "
                f"{d['tokens_per_s']:.1f} tok/s, sent {d['bytes_sent']} B, received {d['bytes_received']} B, "
                f"per call: server {d['verify_server_ms_median']:.1f} ms / round trip {d['verify_rtt_ms_median']:.1f} ms]")


@dataclass
class Generation:
    """tokens: the answer (EOS included when it ended it); sources: who wrote each token (target,
    kept, private, or offline when still unverified at the end)."""

    tokens: list[int]
    stats: GenerationStats
    stopped_by_eos: bool
    sources: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return all(s == TARGET for s in self.sources)


class SpeculativeDecoder:
    """Runs the loop for one drafter against one verifier."""

    def __init__(self, verifier: Verifier, drafter: Drafter, offline: OfflinePolicy = OfflinePolicy()) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.offline = offline

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 *, stop_on_eos: bool = True, on_tokens: TokenCallback | None = None,
                 on_event: EventCallback | None = None, privacy: PrivacyGuard | None = None) -> Generation:
        """Generate up to `max_new_tokens` tokens after `prompt_ids`.

        `privacy` marks private prompt tokens (client/privacy.py); the server then sees placeholders.
        Returns:
            The answer and its stats.
        Raises:
            ValueError: max_new_tokens < 1, an empty prompt, or a privacy guard for another prompt.
            LinkDown: the server is unreachable at the start, offline continuation is disabled, or the
                drafter cannot write alone and the link stays down for `final_wait_s`.
            grpc.RpcError: a refusal from a remote verifier.
        """
        if max_new_tokens < 1 or not prompt_ids:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        if privacy is not None and tuple(privacy.prompt_ids) != tuple(prompt_ids):
            raise ValueError("the privacy guard was built for another prompt")
        run = _Run(self, list(prompt_ids), max_new_tokens, sampling, stop_on_eos, on_tokens, on_event, privacy)
        return run.go()


class _Run:
    """One answer's state. Positions index the full context (prompt + answer); the server holds the
    first `server_cached` positions of the redacted context plus its own pending token."""

    def __init__(self, dec: SpeculativeDecoder, prompt: list[int], budget: int, sampling: SamplingParams,
                 stop_on_eos: bool, on_tokens, on_event, privacy: PrivacyGuard | None) -> None:
        self.verifier, self.drafter, self.policy = dec.verifier, dec.drafter, dec.offline
        self.prompt_len, self.budget, self.sampling = len(prompt), budget, sampling
        self.eos = set(self.verifier.info.eos_token_ids) if stop_on_eos else set()
        self.on_tokens, self.on_event = on_tokens, on_event
        self.privacy = privacy if privacy is not None and privacy.active else None
        self.context = list(prompt)
        self.sources = [PRIVATE if self.privacy and self.privacy.mask[i] else TARGET for i in range(len(prompt))]
        self.rows: dict[int, SparseProbs | None] = {}  # offline position -> the row it was drawn from
        self.stats = GenerationStats()
        self.session = None
        self.server_cached = 0
        self.server_pending = -1
        self.inflight_forced = 0
        self.online = True
        self.link_up = threading.Event()

    # --- the answer -------------------------------------------------------------------------

    @property
    def answer_len(self) -> int:
        return len(self.context) - self.prompt_len

    def finished(self) -> bool:
        return self.answer_len >= self.budget or (self.answer_len > 0 and self.context[-1] in self.eos)

    def view(self, pos: int) -> int:
        """The token the server sees at `pos`."""
        return self.privacy.placeholder if self.sources[pos] == PRIVATE else self.context[pos]

    def _emit(self, event: StreamEvent) -> None:
        if self.on_event:
            self.on_event(event)
        if event.kind == "tokens" and self.on_tokens:
            self.on_tokens(list(event.tokens))

    def append(self, tokens: Sequence[int], source: str, rows: Sequence | None = None) -> int:
        """Append to the answer, cut at EOS and the budget; returns how many were appended."""
        tokens = list(tokens)
        cut = next((i + 1 for i, t in enumerate(tokens) if t in self.eos), len(tokens))
        tokens = tokens[: max(0, min(cut, self.budget - self.answer_len))]
        if not tokens or self.finished():
            return 0
        start = self.answer_len
        for i, token in enumerate(tokens):
            if source == OFFLINE:
                self.rows[len(self.context)] = rows[i] if rows else None
            self.context.append(token)
            self.sources.append(source)
        self.stats.offline_tokens += len(tokens) if source == OFFLINE else 0
        self.stats.private_tokens += len(tokens) if source == PRIVATE else 0
        self._emit(StreamEvent("tokens", start, tuple(tokens), source))
        return len(tokens)

    def relabel(self, start: int, end: int, source: str) -> None:
        """Offline tokens [start, end) (context positions) become `source` (target or kept)."""
        if end <= start:
            return
        for pos in range(start, end):
            self.sources[pos] = source
            self.rows.pop(pos, None)
        self._emit(StreamEvent("verified" if source == TARGET else "kept", start - self.prompt_len, count=end - start))

    def retract(self, pos: int) -> None:
        n = len(self.context) - pos
        del self.context[pos:], self.sources[pos:]
        self.rows = {p: r for p, r in self.rows.items() if p < pos}
        self.stats.retracted_tokens += n
        self.drafter.rollback(pos)
        self._emit(StreamEvent("retract", pos - self.prompt_len))

    # --- the main loop ------------------------------------------------------------------------

    def go(self) -> Generation:
        start = time.perf_counter()
        try:
            self._open(len(self.context))  # LinkDown here propagates: nothing to continue from
            while True:
                if self.online:
                    if self.finished() and OFFLINE not in self.sources[self.server_cached:]:
                        break
                    self._guard(self._step)
                elif self.link_up.is_set():
                    self._guard(self._reconnect)
                elif self.finished():
                    if not self.link_up.wait(self.policy.final_wait_s):
                        log.warning("link still down: the answer ends with unverified tokens")
                        break
                else:
                    self._offline_chunk()
        finally:
            self.link_up.set()  # stops the reconnect thread
            if self.session is not None:
                self.session.close()
        self.stats.new_tokens = self.answer_len
        self.stats.elapsed_s = time.perf_counter() - start
        out = self.context[self.prompt_len:]
        return Generation(out, self.stats, bool(out) and out[-1] in self.eos, self.sources[self.prompt_len:])

    def _guard(self, fn) -> None:
        try:
            fn()
        except LinkDown as err:
            if not self.policy.enabled:
                raise
            self._go_offline(err)
        except SessionLost:
            self._guard(self._reopen)

    def _go_offline(self, err: Exception) -> None:
        log.info("verify service unreachable (%s): continuing with the drafter alone", err)
        self.online = False
        self.stats.disconnects += 1
        self.link_up.clear()
        threading.Thread(target=self._probe_until_up, name="reconnect", daemon=True).start()

    def _probe_until_up(self) -> None:
        attempt = 0
        while not self.link_up.is_set():
            delay = min(self.policy.backoff_max_s, self.policy.backoff_initial_s * 2 ** attempt) * random.random()
            if self.link_up.wait(delay):
                return
            if self.verifier.probe(timeout_s=1.0):
                self.link_up.set()
                return
            attempt += 1

    def _reconnect(self) -> None:
        """The link is back: learn the outcome of the step that failed, then carry on online."""
        if self.session is None:  # the link went down while re-opening
            self.online = True
            self._reopen()
            return
        result = self.session.resume()
        self.online = True
        if result is not None:
            self._record(result)
            self._apply(self.inflight_forced, result)

    # --- server calls -------------------------------------------------------------------------

    def _open(self, upto: int) -> None:
        """A session holding the redacted context [0, upto); the target's next token lands at `upto`."""
        prompt = [self.view(p) for p in range(upto)]
        session, opened = self.verifier.open(prompt, self.sampling, self.drafter.feature_request)
        self.session, self.server_cached, self.server_pending = session, upto, opened.first_token
        self.stats.calls.append(opened.stats)
        self.stats.target_calls += 1
        self.drafter.reset(self.context[:upto], opened.features)
        self._settle(upto, [opened.first_token])

    def _reopen(self) -> None:
        """The server lost the session: open one with everything up to the first unverified token."""
        if self.session is not None:
            self.session.close()
            self.session = None
        self.stats.reopened_sessions += 1
        cut = next((p for p in range(self.prompt_len, len(self.context)) if self.sources[p] == OFFLINE),
                   len(self.context))
        self.drafter.rollback(cut)
        self._open(cut)

    def _step(self) -> None:
        """One Verify call: offline tokens awaiting verification go first (as a chain); forced tokens
        ride along; otherwise the drafter's tree."""
        info = self.verifier.info
        pos = self.server_cached  # the server's pending position
        forced: list[int] = []
        if pos < len(self.context) and (self.view(pos) != self.server_pending
                                        or (pos + 1 < len(self.context) and self.sources[pos + 1] in _FORCED)):
            end = pos + 1
            while end < len(self.context) and self.sources[end] in _FORCED:
                end += 1
            forced = [self.view(p) for p in range(pos, end)]
            pos = end - 1  # the root of the tree
        probs: dict[int, SparseProbs] = {}
        if pos + 1 < len(self.context):  # offline tokens after the root: verify them as a chain
            end = pos + 1
            limit = min(info.max_tree_depth, info.max_tree_nodes)
            while end < len(self.context) and self.sources[end] == OFFLINE and end - pos - 1 < limit:
                end += 1
            tree = DraftTree.chain([self.context[p] for p in range(pos + 1, end)])
            if not self.sampling.greedy:
                probs = {i - 1 if i else ROOT: self.rows[pos + 1 + i] for i in range(tree.size)
                         if self.rows.get(pos + 1 + i) is not None}
                if len(probs) != tree.size:
                    probs = {}  # deterministic offline tokens: one-hot rows on the server
        elif self.finished():
            tree = DraftTree.empty()  # only forced tokens left to hand over: nothing to verify
            if not forced:
                return
        else:
            proposal = self._propose()
            if proposal is None:
                return  # privately produced tokens were written; no call needed for them yet
            tree, probs = proposal.tree, proposal.draft_probs
            self.stats.draft_tokens += tree.size
        self.inflight_forced = len(forced)
        result = self.session.verify(tree, probs, tuple(forced))
        self._record(result)
        self._apply(len(forced), result)

    def _propose(self):
        tic = time.perf_counter()
        # the tree's depth leaves room for the bonus token within the budget
        proposal = self.drafter.propose(self.context, self._limits(self.budget - self.answer_len - 1), self.sampling)
        self.stats.draft_ms += (time.perf_counter() - tic) * 1e3
        if self.privacy is None:
            return proposal
        path, _ = best_path(proposal)
        n = self.privacy.private_run(self.context, path)
        if n:
            self.append(path[:n], PRIVATE)
            return None
        return self.privacy.prune(self.context, proposal)

    def _limits(self, depth: int) -> DraftLimits:
        info = self.verifier.info
        return DraftLimits(max_depth=min(depth, info.max_tree_depth), max_nodes=info.max_tree_nodes,
                           max_support=info.max_draft_support)

    def _record(self, result: StepResult) -> None:
        self.stats.calls.append(result.stats)
        self.stats.target_calls += 1

    def _apply(self, forced: int, result: StepResult) -> None:
        """Fold a Verify result into the answer. The server committed the forced tokens (or its
        pending token) and the accepted tokens, and drew the bonus token."""
        first = self.server_cached + max(forced, 1)  # position of the first accepted token
        cached_end = first + len(result.accepted_tokens)
        facts = [*result.accepted_tokens, result.bonus_token]
        if not self._consistent(first, facts, cached_end):
            self._reopen()
            return
        self.drafter.commit(result.new_tokens, result.features)
        self.server_cached, self.server_pending = cached_end, result.bonus_token
        self._settle(first, facts)

    def _consistent(self, first: int, facts: list[int], cached_end: int) -> bool:
        """False when the server cached a token the client keeps otherwise (a diverging step that ran
        while offline, with keep or a private token there): only a fresh session can fix that."""
        for i, token in enumerate(facts):
            pos = first + i
            if pos >= len(self.context) or self._agrees(pos, token):
                continue
            heal = self.sources[pos] == OFFLINE and self.policy.on_reconnect == "heal"
            if heal:
                self.drafter.rollback(pos)  # before commit: the features cover agreed positions only
            return heal or pos >= cached_end
        return True

    def _agrees(self, pos: int, token: int) -> bool:
        """The answer holds the target's `token` at `pos` (a private token never counts as agreeing:
        the server saw a placeholder there)."""
        return self.context[pos] == token and self.sources[pos] != PRIVATE

    def _settle(self, first: int, facts: list[int]) -> None:
        """Reconcile the target's tokens `facts` at positions first, first+1, ... with the answer."""
        for i, token in enumerate(facts):
            pos = first + i
            if pos >= len(self.context):
                self.append(facts[i:], TARGET)
                return
            if self._agrees(pos, token):
                if self.sources[pos] == OFFLINE:
                    self.relabel(pos, pos + 1, TARGET)
                continue
            if self.sources[pos] == OFFLINE and self.policy.on_reconnect == "heal":
                self.retract(pos)
                self.append(facts[i:], TARGET)
                return
            end = pos  # keep: the offline run from here on stays as written
            while end < len(self.context) and self.sources[end] == OFFLINE:
                end += 1
            self.relabel(pos, end, KEPT)
            return

    # --- offline ------------------------------------------------------------------------------

    def _offline_chunk(self) -> None:
        """Write the drafter's own best path (one proposal's worth of tokens)."""
        proposal = self.drafter.propose(self.context, self._limits(self.budget - self.answer_len), self.sampling)
        path, rows = best_path(proposal)
        if not path:  # a drafter that cannot write alone (none, or ngram without a match): wait, bounded
            if not self.link_up.wait(self.policy.final_wait_s):
                raise LinkDown(f"the verify service is unreachable and the {self.drafter.name} drafter cannot "
                               f"write alone; gave up after {self.policy.final_wait_s:g} s")
        for token, row in zip(path, rows):
            private = self.privacy is not None and self.privacy.completes([*self.context, token])
            if not self.append([token], PRIVATE if private else OFFLINE, [row]) or self.finished():
                return
