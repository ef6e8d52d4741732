"""One answer as the loop writes it: the context's tokens, who wrote each (`Provenance`), and the
`StreamEvent`s that tell a listener about every change.

Positions index the full context (prompt + answer); events index the answer (0 = the first new
token). Offline tokens keep the draft-probability row they were drawn from, so that the target can
verify them losslessly later.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from splitspec.shared.acceptance import SparseProbs

from .privacy import PrivacyGuard


class Provenance(enum.StrEnum):
    """Who wrote a token."""

    TARGET = "target"  # the target (verified)
    OFFLINE = "offline"  # the drafter alone while the link was down; awaiting verification
    KEPT = "kept"  # offline text the target disagreed with, kept as written (--on-reconnect keep)
    PRIVATE = "private"  # reproduced from a private prompt span on this device; never sent


# written by the client for good: sent as forced tokens, never verified
FORCED = (Provenance.KEPT, Provenance.PRIVATE)


class EventKind(enum.StrEnum):
    TOKENS = "tokens"  # tokens appended
    VERIFIED = "verified"  # offline tokens accepted by the target
    KEPT = "kept"  # offline tokens kept though the target disagrees
    RETRACT = "retract"  # tokens withdrawn


@dataclass(frozen=True)
class StreamEvent:
    """One change to the answer; positions index the answer's tokens (0 = the first new token).

    kind TOKENS: `tokens` appended at `start`, written by `source`: TARGET (verified), OFFLINE (the
      drafter alone, awaiting verification) or PRIVATE (reproduced from a private span on this
      device; never sent).
    kind VERIFIED: the `count` offline tokens from `start` on were accepted by the target.
    kind KEPT: the `count` offline tokens from `start` on stay as written though the target
      disagrees from `start` on (--on-reconnect keep).
    kind RETRACT: every token from `start` on is withdrawn (the target rejected the first of them).
    """

    kind: EventKind
    start: int
    tokens: tuple[int, ...] = ()
    source: Provenance = Provenance.TARGET
    count: int = 0

    @property
    def relabelled_to(self) -> Provenance:
        """What a VERIFIED (TARGET) or KEPT (KEPT) event makes its `count` tokens' provenance.

        Raises ValueError for the other kinds, which relabel nothing."""
        if self.kind == EventKind.VERIFIED:
            return Provenance.TARGET
        if self.kind == EventKind.KEPT:
            return Provenance.KEPT
        raise ValueError(f"a {self.kind} event relabels no tokens")


EventCallback = Callable[[StreamEvent], None]


class AnswerTokens:
    """An EventCallback that rebuilds the answer from its events: `ids` and each one's provenance
    (`sources`, as strings), as far as the events went (an answer that failed part way included)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.sources: list[str] = []

    def __call__(self, event: StreamEvent) -> None:
        if event.kind == EventKind.TOKENS:
            self.ids += event.tokens
            self.sources += [str(event.source)] * len(event.tokens)
        elif event.kind == EventKind.RETRACT:
            del self.ids[event.start:], self.sources[event.start:]
        else:  # VERIFIED / KEPT
            self.sources[event.start:event.start + event.count] = [str(event.relabelled_to)] * event.count


class Answer:
    """The context [prompt + answer] with each position's provenance, bounded by `budget` new
    tokens and ended by an EOS token or the caller's `should_stop`. `emit` receives a StreamEvent
    for every change."""

    def __init__(self, prompt: Sequence[int], budget: int, eos: set[int], privacy: PrivacyGuard | None,
                 emit: EventCallback, should_stop: Callable[[], bool] | None = None) -> None:
        """`should_stop`: the caller's own end of the answer (a stop string seen, a listener gone);
        polled as the answer grows, it may turn false again after a retraction."""
        self.prompt_len, self.budget, self.eos, self.privacy, self.emit = len(prompt), budget, eos, privacy, emit
        self.should_stop = should_stop
        self.context = list(prompt)
        self.sources = [Provenance.PRIVATE if privacy and privacy.mask[i] else Provenance.TARGET
                        for i in range(len(prompt))]
        self.rows: dict[int, SparseProbs | None] = {}  # offline position -> the row it was drawn from
        self.written = {source: 0 for source in Provenance}  # tokens appended, by provenance
        self.retracted = 0

    def __len__(self) -> int:
        return len(self.context)

    @property
    def answer_len(self) -> int:
        return len(self.context) - self.prompt_len

    @property
    def new_tokens(self) -> list[int]:
        return self.context[self.prompt_len:]

    @property
    def new_sources(self) -> list[Provenance]:
        return self.sources[self.prompt_len:]

    def finished(self) -> bool:
        return (self.answer_len >= self.budget or (self.answer_len > 0 and self.context[-1] in self.eos)
                or (self.should_stop is not None and self.should_stop()))

    def view(self, pos: int) -> int:
        """The token the server sees at `pos` (a placeholder for a private one)."""
        return self.privacy.placeholder if self.sources[pos] == Provenance.PRIVATE else self.context[pos]

    def agrees(self, pos: int, token: int) -> bool:
        """The answer holds the target's `token` at `pos` (a private token never counts as agreeing:
        the server saw a placeholder there)."""
        return self.context[pos] == token and self.sources[pos] != Provenance.PRIVATE

    def first_unverified(self) -> int:
        """The first offline position of the answer, else its length."""
        return next((p for p in range(self.prompt_len, len(self)) if self.sources[p] == Provenance.OFFLINE), len(self))

    def run_end(self, pos: int, sources: Sequence[Provenance], limit: int | None = None) -> int:
        """The end of the run of positions from `pos` on whose provenance is among `sources`, at
        most `limit` long."""
        end = pos
        while end < len(self) and self.sources[end] in sources and (limit is None or end - pos < limit):
            end += 1
        return end

    def append(self, tokens: Sequence[int], source: Provenance, rows: Sequence | None = None) -> int:
        """Append to the answer, cut at EOS and the budget; returns how many were appended."""
        tokens = list(tokens)
        cut = next((i + 1 for i, t in enumerate(tokens) if t in self.eos), len(tokens))
        tokens = tokens[: max(0, min(cut, self.budget - self.answer_len))]
        if not tokens or self.finished():
            return 0
        start = self.answer_len
        for i, token in enumerate(tokens):
            if source == Provenance.OFFLINE:
                self.rows[len(self.context)] = rows[i] if rows else None
            self.context.append(token)
            self.sources.append(source)
        self.written[source] += len(tokens)
        self.emit(StreamEvent(EventKind.TOKENS, start, tuple(tokens), source))
        return len(tokens)

    def relabel(self, start: int, end: int, source: Provenance) -> None:
        """Offline tokens [start, end) become `source` (TARGET or KEPT)."""
        if end <= start:
            return
        for pos in range(start, end):
            self.sources[pos] = source
            self.rows.pop(pos, None)
        kind = EventKind.VERIFIED if source == Provenance.TARGET else EventKind.KEPT
        self.emit(StreamEvent(kind, start - self.prompt_len, count=end - start))

    def retract(self, pos: int) -> None:
        """Withdraw every token from `pos` on."""
        self.retracted += len(self.context) - pos
        del self.context[pos:], self.sources[pos:]
        self.rows = {p: r for p, r in self.rows.items() if p < pos}
        self.emit(StreamEvent(EventKind.RETRACT, pos - self.prompt_len))
