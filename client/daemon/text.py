"""An answer's text as the loop's stream events arrive, cut into the deltas the API streams.

Offsets are characters of the decoded answer (special tokens skipped). A delta is held back while
the text ends in an incomplete character or in what may be the start of a stop string, and
nothing from the first stop string on is ever sent. Offline text the target later rejects is
withdrawn by a `retract` delta (docs/daemon.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..answer import AnswerTokens, EventKind, StreamEvent


@dataclass(frozen=True)
class Delta:
    """One piece of what the client is told.

    content: text appended at character `offset` (empty for the events below).
    source: who wrote `content`: target, offline (the drafter alone, awaiting verification) or
      private (reproduced from a private span on this device, never sent).
    event: "" for text; "verified" / "kept": the text [offset, end) was offline and is now the
      target's / kept as written; "retract": the text from `offset` on is withdrawn and the deltas
      that follow continue from there.
    """

    content: str = ""
    offset: int = 0
    source: str = ""
    event: str = ""
    end: int = 0

    def extension(self) -> dict:
        """The delta's `splitspec` field."""
        if self.event == "retract":
            return {"event": "retract", "offset": self.offset}
        if self.event:
            return {"event": self.event, "offset": self.offset, "end": self.end}
        return {"source": self.source, "offset": self.offset}


class AnswerText:
    """Folds StreamEvents into text deltas. `stop`: strings that end the answer (not included).

    Each delta's `source` is that of the tokens that wrote its text: text held back (a possible
    stop string's start, an incomplete character) and sent with later tokens' text is split where
    the writer changes, so private text is never labelled another source (QA 57 finding 4).

    `context`: the prompt's last tokens, when the answer continues the prompt's text as written (a
    text completion): the answer is decoded after them, since a SentencePiece tokenizer drops the
    leading space of the first token it decodes (" time" of "Once upon a" came out "time", QA 58).
    A chat answer starts a message of its own and takes none."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), context: Sequence[int] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self._context = list(context)
        self._after = tokenizer.decode(self._context, skip_special_tokens=True) if self._context else ""
        if self._after.endswith("\ufffd"):  # a character the answer's first token may complete: not a fixed prefix
            self._context, self._after = [], ""
        self.tokens = AnswerTokens()  # ids and each one's provenance, relabels applied
        self.sent = 0  # characters of the answer already sent
        self.stop_at: int | None = None  # where the first stop string begins, once seen
        self.retracted = False
        self._offsets: dict[int, int] = {}  # token count k -> characters ids[:k] decode to

    @property
    def ids(self) -> list[int]:
        return self.tokens.ids

    @property
    def stopped(self) -> bool:
        """A stop string was written (a retraction may withdraw it again)."""
        return self.stop_at is not None

    def feed(self, event: StreamEvent) -> list[Delta]:
        """The deltas `event` makes; raises nothing."""
        self.tokens(event)
        if event.kind == EventKind.TOKENS:
            return self._flush(final=False)
        if event.kind == EventKind.RETRACT:
            self._offsets = {k: c for k, c in self._offsets.items() if k <= event.start}
            at = self._chars(event.start)
            self._find_stop()
            if at >= self.sent:
                return []
            self.sent, self.retracted = at, True
            return [Delta(offset=at, event="retract")]
        start, end = self._chars(event.start), self._chars(event.start + event.count)
        start, end = min(start, self.sent), min(end, self.sent)
        return [Delta(offset=start, end=end, event=str(event.kind))] if end > start else []

    def finish(self) -> list[Delta]:
        """What is still held back once the answer is complete."""
        return self._flush(final=True)

    @property
    def text(self) -> str:
        """The answer's text, cut at the first stop string, without a last character the tokens
        end inside of (an answer cut by max_tokens: its U+FFFD would be noise; vLLM's incremental
        detokenizer drops it the same way, never releasing text that ends in U+FFFD)."""
        text = self._text()
        return text[: self.stop_at] if self.stop_at is not None else text.rstrip("\ufffd")

    def tokens_holding(self, chars: int) -> int:
        """The fewest of the answer's tokens whose text holds its first `chars` characters: the
        answer's tokens when a stop string cut it (the step that wrote the stop may have accepted
        more). Decoded as the answer is (after the context), so a text completion's leading space
        counts (decoded alone, a SentencePiece answer counted one token too many, the review of QA
        58's fix). A binary search: O(log n) decodes."""
        lo, hi = 0, len(self.ids)  # the answer lies in [lo, hi]; all the ids hold the text
        while lo < hi:
            mid = (lo + hi) // 2
            if self._chars(mid) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _flush(self, final: bool) -> list[Delta]:
        text = self._text()
        self._find_stop(text)
        end = self.stop_at if self.stop_at is not None else (
            len(text.rstrip("\ufffd")) if final else self._safe_end(text))
        if end <= self.sent:
            return []
        deltas = []
        for start, stop, source in self._runs(self.sent, end):
            deltas.append(Delta(text[start:stop], start, source))
        self.sent = end
        return deltas

    def _runs(self, start: int, end: int) -> list[tuple[int, int, str]]:
        """The characters [start, end) cut where the tokens' writer changes: (start, end, source)."""
        sources = self.tokens.sources
        changes = [(self._chars(k), sources[k]) for k in range(1, len(sources)) if sources[k] != sources[k - 1]]
        bounds = [(0, sources[0])] + changes if sources else [(0, "target")]
        runs = []
        for i, (at, source) in enumerate(bounds):
            upto = bounds[i + 1][0] if i + 1 < len(bounds) else end
            lo, hi = max(at, start), min(upto, end)
            if hi > lo:
                runs.append((lo, hi, source))
        return runs

    def _safe_end(self, text: str) -> int:
        """The end of the text that can be sent now: before an incomplete character and before a
        suffix that begins a stop string."""
        end = len(text.rstrip("\ufffd"))
        for stop in self.stop:
            for k in range(min(len(stop) - 1, end), 0, -1):
                if text[end - k: end] == stop[:k]:
                    end -= k
                    break
        return end

    def _find_stop(self, text: str | None = None) -> None:
        text = self._text() if text is None else text
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        self.stop_at = min(hits) if hits else None

    def _chars(self, tokens: int) -> int:
        """Characters the first `tokens` ids decode to (cached: a prefix decodes the same until a
        retraction cuts into it)."""
        if tokens not in self._offsets:
            self._offsets[tokens] = len(self.decode(self.ids[:tokens]))
        return self._offsets[tokens]

    def _text(self) -> str:
        return self.decode(self.ids)

    def decode(self, ids: list[int]) -> str:
        """The text `ids` add after the context (all of their text without one)."""
        if not self._context:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        text = self.tokenizer.decode(self._context + ids, skip_special_tokens=True)
        if not text.startswith(self._after):  # a tokenizer that decodes across the seam otherwise
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return text[len(self._after):]
