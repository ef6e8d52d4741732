"""Terminal output of an answer as the loop's stream events arrive (generate, chat, demo)."""
from __future__ import annotations

import sys

from .answer import AnswerTokens


class TextStream:
    """Prints the answer as stream events arrive (client/loop.py StreamEvent).

    On a terminal, offline text (written by the drafter alone while the link is down) is dim until
    the target confirms it; private text (reproduced from a <private> span on this device) is
    underlined; when the target rewrites offline text, a marker shows where and the corrected text
    follows. To a file or a pipe, where nothing can be dimmed or taken back, offline text is held
    until the target confirms it (or it is kept, or the answer ends with it) and withdrawn text is
    never written, so the output is the answer (QA 56: a retraction left the withdrawn text, and its
    marker, in a redirected answer); call `finish` when the answer is over. Whole-answer decoding
    keeps multi-byte characters intact."""

    STYLE = {"offline": "\x1b[2m", "private": "\x1b[4m"}

    def __init__(self, tokenizer, out=sys.stdout) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.color = hasattr(out, "isatty") and out.isatty()
        self.answer = AnswerTokens()  # the answer's ids and who wrote each, as the events leave them
        self.printed = 0  # characters of the decoded answer already written

    @property
    def ids(self) -> list[int]:
        return self.answer.ids

    def __call__(self, event) -> None:
        self.answer(event)
        if event.kind == "retract":
            if self.color:
                self.printed = len(self._text(self.ids))
                self.out.write(" [link back: the target rewrote the offline text from here] ")
        elif event.kind in ("verified", "kept"):
            if self.color and event.kind == "kept":
                self.out.write(" [link back: offline text kept] ")
            elif not self.color:
                self._write(self._confirmed(), None)
        elif event.kind == "tokens":
            ids = self.ids if self.color else self._confirmed()
            self._write(ids, self.STYLE.get(event.source) if self.color else None)
        self.out.flush()

    def finish(self) -> None:
        """The answer is over: write what is still held (offline text the link never came back to
        confirm, which the answer keeps; a last character cut by the token budget)."""
        self._write(self.ids, None, whole=True)
        self.out.flush()

    def _confirmed(self) -> list[int]:
        """The answer's tokens before its first unconfirmed offline one."""
        sources = self.answer.sources
        end = sources.index("offline") if "offline" in sources else len(sources)
        return self.ids[:end]

    def _write(self, ids: list[int], style: str | None, whole: bool = False) -> None:
        text = self._text(ids)
        if (text.endswith("\ufffd") and not whole) or len(text) <= self.printed:  # an incomplete character:
            return  # wait for its next byte
        piece = text[self.printed:]
        self.out.write(f"{style}{piece}\x1b[0m" if style else piece)
        self.printed = len(text)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
