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
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from splitspec.shared.config import TreeConfig
from splitspec.shared.records import AnswerRecord
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import DraftTree
from splitspec.shared.verifier import CallStats, LinkDown, OpenCancelled, SessionLost, StepResult, Verifier

from .answer import Answer, EventCallback, EventKind, Provenance, StreamEvent
from .drafters import DraftLimits, Drafter, Proposal
from .plan import ServerView, StepLimits, plan_step
from .privacy import PrivacyGuard, best_path
from .reconnect import OfflinePolicy, ReconnectProbe
from .tree_planner import TreePlanner

log = logging.getLogger(__name__)

# on_tokens(new_token_ids): called as tokens are appended to the answer (any source), for streaming
TokenCallback = Callable[[list[int]], None]

TARGET, OFFLINE, KEPT, PRIVATE = Provenance  # short names of the provenances, as the tests and callers use them


@dataclass
class GenerationStats:
    """Per-answer figures. tau: the papers' accept length, tokens per verify call (accepted +
    bonus; shared/records.py `accept_length`); open and verify calls both count as target calls."""

    new_tokens: int = 0
    target_calls: int = 0
    draft_tokens: int = 0  # tree nodes sent
    elapsed_s: float = 0.0
    draft_ms: float = 0.0  # time spent in drafter.propose
    calls: list[CallStats] = field(default_factory=list)
    offline_tokens: int = 0  # written by the drafter alone while the link was down
    private_tokens: int = 0  # reproduced from private spans on this device
    retracted_tokens: int = 0  # offline tokens withdrawn after the target rejected them (heal)
    unverified_tokens: int = 0  # answer tokens no verify call produced (offline at the end, kept, private)
    disconnects: int = 0
    reopened_sessions: int = 0
    trees: dict[str, int] = field(default_factory=dict)  # tree shapes a network-aware planner chose: "DxBxN" -> calls

    def record(self) -> AnswerRecord:
        """The answer's counts, as benchmarks pool them."""
        opened = self.calls[0] if self.calls else CallStats(0.0, 0.0, 0.0)
        return AnswerRecord(self.new_tokens, self.target_calls, self.elapsed_s, self.bytes_sent, self.bytes_received,
                            opened.bytes_sent, opened.bytes_received, self.server_ms, self.unverified_tokens)

    @property
    def tau(self) -> float:
        return self.record().tau

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
        """The figures as plain JSON values: tau is None (null) for an answer that made no verify
        call (one token, from the open call alone), where it is undefined (NaN is not JSON)."""
        rtts = [c.rtt_ms for c in self.calls[1:]] or [0.0]
        servers = [c.server_total_ms for c in self.calls[1:]] or [0.0]
        tau = self.tau
        return {
            "new_tokens": self.new_tokens, "target_calls": self.target_calls,
            "tau": round(tau, 3) if math.isfinite(tau) else None,
            "draft_tokens": self.draft_tokens, "elapsed_s": round(self.elapsed_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 2), "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received, "draft_ms": round(self.draft_ms, 1),
            "verify_rtt_ms_median": round(statistics.median(rtts), 2),
            "verify_server_ms_median": round(statistics.median(servers), 2),
            "offline_tokens": self.offline_tokens, "private_tokens": self.private_tokens,
            "retracted_tokens": self.retracted_tokens, "unverified_tokens": self.unverified_tokens,
            "disconnects": self.disconnects,
            "reopened_sessions": self.reopened_sessions,
            **({"trees": dict(self.trees)} if self.trees else {}),
        }

    def summary(self) -> str:
        d = self.as_dict()
        tau = "-" if d["tau"] is None else f"{d['tau']:.2f}"
        unverified = f" ({d['unverified_tokens']} unverified: offline, kept or private)" if d["unverified_tokens"] else ""
        return (f"[{d['new_tokens']} tokens{unverified}, {d['target_calls']} target calls, tau {tau}, "
                f"{d['tokens_per_s']:.1f} tok/s, sent {d['bytes_sent']} B, received {d['bytes_received']} B, "
                f"per call: server {d['verify_server_ms_median']:.1f} ms / round trip {d['verify_rtt_ms_median']:.1f} ms]")


@dataclass
class Generation:
    """tokens: the answer (EOS included when it ended it); sources: who wrote each token (target,
    kept, private, or offline when still unverified at the end)."""

    tokens: list[int]
    stats: GenerationStats
    stopped_by_eos: bool
    sources: list[Provenance] = field(default_factory=list)
    context_full: bool = False  # the answer stopped because the target's context holds no more tokens

    @property
    def verified(self) -> bool:
        return all(s == Provenance.TARGET for s in self.sources)


class SpeculativeDecoder:
    """Runs the loop for one drafter against one verifier.

    `planner`: a network-aware TreePlanner (client/tree_planner.py) that picks the tree shape of
    each proposal from measured link, verify and drafting times and acceptance; only for drafters
    that draft EAGLE-2 dynamic trees (they hold a `tree: TreeConfig`).

    Raises:
        ValueError: a planner for a drafter without a tree shape.
    """

    def __init__(self, verifier: Verifier, drafter: Drafter, offline: OfflinePolicy = OfflinePolicy(),
                 planner: TreePlanner | None = None) -> None:
        if planner is not None and not isinstance(getattr(drafter, "tree", None), TreeConfig):
            raise ValueError(f"the {drafter.name} drafter has no tree shape to adapt; network-aware trees are for "
                             "moa, eagle2, falcon, tokenswift and draft-model")
        self.verifier = verifier
        self.drafter = drafter
        self.offline = offline
        self.planner = planner

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 *, stop_on_eos: bool = True, on_tokens: TokenCallback | None = None,
                 on_event: EventCallback | None = None, privacy: PrivacyGuard | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> Generation:
        """Generate up to `max_new_tokens` tokens after `prompt_ids`.

        `privacy` marks private prompt tokens (client/privacy.py); the server then sees placeholders.
        `should_stop`: polled as the answer grows; True ends it early, as EOS would (a stop string
        seen, a listener gone; offline text is still verified first, and a retraction may make it
        false again). `cancelled`: polled before every step, while waiting for the link and while a
        session's prefill runs (`Verifier.open`: between chunks in-process, over gRPC by cancelling
        the call); True (the listener went away) ends the answer at once, as it stands: no
        verification of offline text, no wait for the link, and no CloseSession over a link that is down.
        The answer stops where the target's context (`ServerInfo.max_context`) is full, with
        `context_full` set, and no step sends more positions than the context has room for.
        Returns:
            The answer and its stats.
        Raises:
            ValueError: max_new_tokens < 1, an empty prompt, a prompt that fills the target's context,
                or a privacy guard for another prompt.
            LinkDown: the server is unreachable at the start, offline continuation is disabled, or the
                drafter cannot write alone and the link stays down for `final_wait_s`.
            grpc.RpcError: a refusal from a remote verifier.
        """
        if max_new_tokens < 1 or not prompt_ids:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        if privacy is not None and tuple(privacy.prompt_ids) != tuple(prompt_ids):
            raise ValueError("the privacy guard was built for another prompt")
        room = self.verifier.info.max_context - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt's {len(prompt_ids)} tokens fill the target's context of "
                             f"{self.verifier.info.max_context} tokens")
        self.drafter.reseed(sampling.seed)  # the answer's drafts depend on its seed alone
        run = _Run(self, list(prompt_ids), min(max_new_tokens, room), sampling, stop_on_eos, on_tokens, on_event,
                   privacy, should_stop, cancelled)
        generation = run.go()
        generation.context_full = (max_new_tokens > room and len(generation.tokens) >= room
                                   and not generation.stopped_by_eos)
        return generation


class _Run:
    """One answer's run: the `Answer`, the client's `ServerView` of its session, the reconnect probe.
    Positions index the full context (prompt + answer)."""

    def __init__(self, dec: SpeculativeDecoder, prompt: list[int], budget: int, sampling: SamplingParams,
                 stop_on_eos: bool, on_tokens, on_event, privacy: PrivacyGuard | None, should_stop=None,
                 cancelled: Callable[[], bool] | None = None) -> None:
        self.verifier, self.drafter, self.policy, self.sampling = dec.verifier, dec.drafter, dec.offline, sampling
        self.planner = dec.planner
        self.on_tokens, self.on_event = on_tokens, on_event
        self.privacy = privacy if privacy is not None and privacy.active else None
        eos = set(self.verifier.info.eos_token_ids) if stop_on_eos else set()
        self.answer = Answer(prompt, budget, eos, self.privacy, self._emit, should_stop)
        self.cancelled = cancelled or (lambda: False)
        self._open_cancelled = cancelled  # handed to opens: a long prefill stops when it returns True
        self.stats = GenerationStats()
        self.session = None
        self.server = ServerView(0, -1)
        self.inflight_forced = 0
        self._commit_ms: float | None = None  # the last step's drafter.commit, ms (None: it did not commit)
        self.online = True
        self.link = ReconnectProbe(lambda: self.verifier.probe(timeout_s=1.0), self.policy.backoff_initial_s,
                                   self.policy.backoff_max_s)

    def _emit(self, event: StreamEvent) -> None:
        if self.on_event:
            self.on_event(event)
        if event.kind == EventKind.TOKENS and self.on_tokens:
            self.on_tokens(list(event.tokens))

    # --- the main loop ------------------------------------------------------------------------

    def go(self) -> Generation:
        start = time.perf_counter()
        try:
            self._open_first()
            while self._turn():
                pass
        except OpenCancelled:  # cancelled during a prefill: the answer ends as it stands
            pass
        finally:
            self.link.stop()
            if self.session is not None and self.online:  # over a dead link the call would only wait out
                self.session.close()                      # its deadline; the server drops idle sessions itself
        answer = self.answer
        self.stats.new_tokens = answer.answer_len
        self.stats.elapsed_s = time.perf_counter() - start
        self.stats.offline_tokens, self.stats.private_tokens = answer.written[OFFLINE], answer.written[PRIVATE]
        self.stats.retracted_tokens = answer.retracted
        self.stats.unverified_tokens = sum(s != TARGET for s in answer.new_sources)  # offline, kept, private
        out = answer.new_tokens
        return Generation(out, self.stats, bool(out) and out[-1] in answer.eos, answer.new_sources)

    def _turn(self) -> bool:
        """One step online, one reconnection, or one offline chunk; False when the answer is done."""
        answer = self.answer
        if self.cancelled():
            return False
        if self.online:
            if answer.finished() and OFFLINE not in answer.sources[self.server.cached:]:
                return False
            self._guard(self._step)
        elif self.link.up:
            self._guard(self._reconnect)
        elif answer.finished():
            if not self.link.wait(self.policy.final_wait_s, abandon=self.cancelled):
                if not self.cancelled():
                    log.warning("link still down: the answer ends with unverified tokens")
                return False
        else:
            self._offline_chunk()
        return True

    def _guard(self, fn) -> None:
        try:
            fn()
        except LinkDown as err:
            if not self.policy.enabled:  # --no-offline: the answer fails; no CloseSession over the dead
                self.online = False      # link, which would only wait out its 5 s deadline (QA 57)
                raise
            self._go_offline(err)
        except SessionLost:
            self._guard(self._reopen)

    def _go_offline(self, err: Exception) -> None:
        log.info("verify service unreachable (%s): continuing with the drafter alone", err)
        self.online = False
        self.stats.disconnects += 1
        self.link.start()

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
        prompt = [self.answer.view(p) for p in range(upto)]
        session, opened = self.verifier.open(prompt, self.sampling, self.drafter.feature_request,
                                             cancelled=self._open_cancelled)
        self.session, self.server = session, ServerView(upto, opened.first_token)
        self.stats.calls.append(opened.stats)
        self.stats.target_calls += 1
        self.drafter.reset(self.answer.context[:upto], opened.features)
        self._settle(upto, [opened.first_token])

    def _open_first(self) -> None:
        """The answer's first session. The drafter cannot write before it (its features come with
        it), so while the link is down (a server restarting) it waits, as an offline answer's end
        does, up to the policy's `final_wait_s` for the link to return, then tries once more.

        Raises:
            LinkDown: offline continuation disabled, or the link still down after the wait.
        """
        try:
            self._open(len(self.answer))
            return
        except LinkDown as err:
            if not self.policy.enabled:
                raise
            log.info("verify service unreachable (%s): waiting up to %g s to open the session", err,
                     self.policy.final_wait_s)
        self.stats.disconnects += 1  # as a link lost mid-answer is counted (QA 57: this one was not)
        self.link.start()
        if not self.link.wait(self.policy.final_wait_s, abandon=self.cancelled):
            raise LinkDown(f"the verify service stayed unreachable for {self.policy.final_wait_s:g} s")
        self._open(len(self.answer))

    def _reopen(self) -> None:
        """The server lost the session: open one with everything up to the first unverified token."""
        if self.session is not None:
            self.session.close()
            self.session = None
        self.stats.reopened_sessions += 1
        cut = self.answer.first_unverified()
        self.drafter.rollback(cut)
        self._open(cut)

    def _step(self) -> None:
        """One Verify call, as `plan_step` decides it; the drafter proposes when the plan asks."""
        info = self.verifier.info
        limits = StepLimits(info.max_tree_depth, info.max_tree_nodes, sampled=not self.sampling.greedy)
        plan = plan_step(self.answer, self.server, limits)
        if plan is None:
            return
        room = self._room(len(plan.forced))
        if plan.tree is not None and plan.tree.size > room:  # an offline chain longer than the context's room
            plan = plan_step(self.answer, self.server, StepLimits(min(limits.max_tree_depth, room),
                                                                  min(limits.max_tree_nodes, room), limits.sampled))
        tree, probs = plan.tree, plan.draft_probs
        drafted, own_nodes = tree is None, None
        if drafted:
            draft_start = self.stats.draft_ms
            proposal = self._propose(room)
            if proposal is None:
                return  # privately produced tokens were written; no call needed for them yet
            tree, probs, own_nodes = proposal.tree, proposal.draft_probs, proposal.drafted
            self.stats.draft_tokens += tree.size
        self.inflight_forced = len(plan.forced)
        result = self.session.verify(tree, probs, plan.forced)
        self._record(result)
        self._apply(len(plan.forced), result)
        if drafted and self.planner is not None and not plan.forced:  # empty trees too: link and verify(1) times
            self.planner.observe(tree, result.accepted_tokens, result.stats, self.stats.draft_ms - draft_start,
                                 drafted=own_nodes, commit_ms=self._commit_ms)

    def _propose(self, room: int):
        """The drafter's tree for the next step; `room`: the most nodes the target's context takes."""
        answer = self.answer
        tic = time.perf_counter()
        # the tree's depth leaves room for the bonus token within the budget
        limits = self._limits(answer.budget - answer.answer_len - 1, room)
        if limits.max_depth < 1:  # the last token of the budget or the context: the bonus token alone
            if self.planner is not None:  # no tree sent, none chosen (the planner counted a 1x1x1 here)
                self.stats.trees["none"] = self.stats.trees.get("none", 0) + 1
            return Proposal(DraftTree.empty())
        if self.planner is not None:
            tree = self.planner.choose(limits.max_depth, limits.max_nodes)
            shape = "none" if tree is None else f"{tree.depth}x{tree.top_b}x{tree.max_nodes}"
            self.stats.trees[shape] = self.stats.trees.get(shape, 0) + 1
            if tree is None:  # speculation does not pay now: one target token per call
                return Proposal(DraftTree.empty())
            self.drafter.tree = tree
        proposal = self.drafter.propose(answer.context, limits, self.sampling)
        self.stats.draft_ms += (time.perf_counter() - tic) * 1e3
        if self.privacy is None:
            return proposal
        path, _ = best_path(proposal)
        n = self.privacy.private_run(answer.context, path)
        if n:
            answer.append(path[:n], PRIVATE)
            return None
        return self.privacy.prune(answer.context, proposal)

    def _limits(self, depth: int, room: int | None = None) -> DraftLimits:
        info = self.verifier.info
        nodes = info.max_tree_nodes if room is None else min(info.max_tree_nodes, room)
        return DraftLimits(max_depth=min(depth, info.max_tree_depth, nodes), max_nodes=nodes,
                           max_support=info.max_draft_support)

    def _room(self, forced: int) -> int:
        """Tree nodes the target's context still takes in a step that commits `forced` tokens (or the
        pending one): the server counts the cached context, those tokens and the tree."""
        return max(0, self.verifier.info.max_context - self.server.cached - max(forced, 1))

    def _record(self, result: StepResult) -> None:
        self.stats.calls.append(result.stats)
        self.stats.target_calls += 1

    def _apply(self, forced: int, result: StepResult) -> None:
        """Fold a Verify result into the answer. The server committed the forced tokens (or its
        pending token) and the accepted tokens, and drew the bonus token."""
        first = self.server.cached + max(forced, 1)  # position of the first accepted token
        cached_end = first + len(result.accepted_tokens)
        facts = [*result.accepted_tokens, result.bonus_token]
        self._commit_ms = None
        if not self._consistent(first, facts, cached_end):
            self._reopen()
            return
        tic = time.perf_counter()
        self.drafter.commit(result.new_tokens, result.features)
        self._commit_ms = (time.perf_counter() - tic) * 1e3  # the planner prices it (MoA's LSA runs here)
        self.server = ServerView(cached_end, result.bonus_token)
        self._settle(first, facts)

    def _heals(self, pos: int) -> bool:
        """The target's disagreement at `pos` replaces the answer from there (offline text, heal)."""
        return self.answer.sources[pos] == OFFLINE and self.policy.on_reconnect == "heal"

    def _consistent(self, first: int, facts: list[int], cached_end: int) -> bool:
        """False when the server cached a token the client keeps otherwise (a diverging step that ran
        while offline, with keep or a private token there): only a fresh session can fix that."""
        for i, token in enumerate(facts):
            pos = first + i
            if pos >= len(self.answer) or self.answer.agrees(pos, token):
                continue
            heal = self._heals(pos)
            if heal:
                self.drafter.rollback(pos)  # before commit: the features cover agreed positions only
            return heal or pos >= cached_end
        return True

    def _settle(self, first: int, facts: list[int]) -> None:
        """Reconcile the target's tokens `facts` at positions first, first+1, ... with the answer."""
        answer = self.answer
        for i, token in enumerate(facts):
            pos = first + i
            if pos >= len(answer):
                answer.append(facts[i:], TARGET)
                return
            if answer.agrees(pos, token):
                if answer.sources[pos] == OFFLINE:
                    answer.relabel(pos, pos + 1, TARGET)
                continue
            if self._heals(pos):
                answer.retract(pos)
                self.drafter.rollback(pos)
                answer.append(facts[i:], TARGET)
                return
            answer.relabel(pos, answer.run_end(pos, (OFFLINE,)), KEPT)  # keep: the offline run stays as written
            return

    # --- offline ------------------------------------------------------------------------------

    def _offline_chunk(self) -> None:
        """Write the drafter's own best path (one proposal's worth of tokens)."""
        answer = self.answer
        proposal = self.drafter.propose(answer.context, self._limits(answer.budget - answer.answer_len), self.sampling)
        path, rows = best_path(proposal)
        if not path:  # a drafter that cannot write alone (none, or ngram without a match): wait, bounded
            if not self.link.wait(self.policy.final_wait_s, abandon=self.cancelled):
                if self.cancelled():
                    return
                raise LinkDown(f"the verify service is unreachable and the {self.drafter.name} drafter cannot "
                               f"write alone; gave up after {self.policy.final_wait_s:g} s")
        flags = [False] * len(path)
        if self.privacy is not None:
            path, rows, flags = self._private_offline(path, rows)
        for token, row, private in zip(path, rows, flags):
            if not answer.append([token], PRIVATE if private else OFFLINE, [row]) or answer.finished():
                return

    def _private_offline(self, path: list[int], rows: list) -> tuple[list[int], list, list[bool]]:
        """Which tokens of an offline path reproduce private text: every token of each private
        n-gram the path completes, the n-gram's first tokens included (they complete none
        themselves, and were labelled offline: sent in clear as forced tokens with --on-reconnect
        keep, and left outside the `<private>` tags of a chat history). Tokens of such an n-gram
        written offline by an earlier chunk are withdrawn and written again as private. Returns
        (path, rows, private flags), the path extended at its front by those tokens."""
        answer, guard = self.answer, self.privacy
        n = guard.ngram
        flags = [guard.completes([*answer.context, *path[:i + 1]]) for i in range(len(path))]
        for i in [i for i, hit in enumerate(flags) if hit]:
            flags[max(0, i - n + 1):i] = [True] * (i - max(0, i - n + 1))
        first = next((i for i, hit in enumerate(flags) if hit), None)
        if first is None or first >= n - 1:
            return path, rows, flags
        start = max(len(answer.context) - (n - 1 - first), answer.prompt_len)
        back = next((p for p in range(start, len(answer.context)) if answer.sources[p] == OFFLINE), None)
        if back is None:
            return path, rows, flags
        earlier = answer.context[back:]
        earlier_rows = [answer.rows.get(p) for p in range(back, len(answer.context))]
        answer.retract(back)
        self.drafter.rollback(back)
        return [*earlier, *path], [*earlier_rows, *rows], [True] * len(earlier) + flags
