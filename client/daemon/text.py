"""An answer's text as the loop's stream events arrive, cut into the deltas the API streams.

Offsets are characters of the decoded answer (special tokens skipped). A delta is held back while
the text ends in an incomplete character or in what may be the start of a stop string, and
nothing from the first stop string on is ever sent. Offline text the target later rejects is
withdrawn by a `retract` delta (docs/daemon.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..answer import EventKind, StreamEvent


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


@dataclass
class AnswerText:
    """Folds StreamEvents into text deltas. `stop`: strings that end the answer (not included)."""

    tokenizer: object
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the answer already sent
    stop_at: int | None = None  # where the first stop string begins, once seen
    retracted: bool = False
    source: str = "target"  # who wrote the last tokens

    @property
    def stopped(self) -> bool:
        """A stop string was written (a retraction may withdraw it again)."""
        return self.stop_at is not None

    def feed(self, event: StreamEvent) -> list[Delta]:
        """The deltas `event` makes; raises nothing."""
        if event.kind == EventKind.TOKENS:
            self.ids.extend(event.tokens)
            self.source = str(event.source)
            return self._flush(self.source, final=False)
        if event.kind == EventKind.RETRACT:
            del self.ids[event.start:]
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
        return self._flush(self.source, final=True)

    @property
    def text(self) -> str:
        """The answer's text, cut at the first stop string, without a last character the tokens
        end inside of (an answer cut by max_tokens: its U+FFFD would be noise; vLLM's incremental
        detokenizer drops it the same way, never releasing text that ends in U+FFFD)."""
        text = self._text()
        return text[: self.stop_at] if self.stop_at is not None else text.rstrip("\ufffd")

    def _flush(self, source: str, final: bool) -> list[Delta]:
        text = self._text()
        self._find_stop(text)
        end = self.stop_at if self.stop_at is not None else (
            len(text.rstrip("\ufffd")) if final else self._safe_end(text))
        if end <= self.sent:
            return []
        delta = Delta(text[self.sent: end], self.sent, source)
        self.sent = end
        return [delta]

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
        return len(self.tokenizer.decode(self.ids[:tokens], skip_special_tokens=True))

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)
