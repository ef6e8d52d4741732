"""Terminal output of an answer as the loop's stream events arrive (generate, chat, demo)."""
from __future__ import annotations

import sys


class TextStream:
    """Prints the answer as stream events arrive (client/loop.py StreamEvent). Offline text (written
    by the drafter alone while the link is down) is dim until the target confirms it; private text
    (reproduced from a <private> span on this device) is underlined; when the target rewrites offline
    text, a marker shows where and the corrected text follows. Whole-answer decoding keeps
    multi-byte characters intact."""

    STYLE = {"offline": "\x1b[2m", "private": "\x1b[4m"}

    def __init__(self, tokenizer, out=sys.stdout) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.color = hasattr(out, "isatty") and out.isatty()
        self.ids: list[int] = []
        self.printed = 0  # characters of the decoded answer already written

    def __call__(self, event) -> None:
        if event.kind == "retract":
            del self.ids[event.start:]
            self.printed = len(self._text())
            self.out.write(" [link back: the target rewrote the offline text from here] ")
        elif event.kind == "kept":
            self.out.write(" [link back: offline text kept] ")
        elif event.kind == "tokens":
            self.ids.extend(event.tokens)
            text = self._text()
            if text.endswith("\ufffd"):  # an incomplete character: wait for its next byte
                return
            piece = text[self.printed:]
            style = self.STYLE.get(event.source) if self.color else None
            self.out.write(f"{style}{piece}\x1b[0m" if style and piece else piece)
            self.printed = len(text)
        self.out.flush()

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)
