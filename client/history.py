"""The chat history: a local SQLite file written as tokens commit, so a crash of either side loses
no conversation.

Tables: `conversations` (one per chat), `messages` (role, text, complete flag) and `tokens` (the
answer being written: position, token id, who wrote it — target, offline, kept, private). Stream
events (client/loop.py StreamEvent) are applied as they arrive, each in its own transaction; when
an answer completes its text is stored in `messages` and its token rows stay for inspection.
An answer interrupted by a crash is found with `complete = 0`; `recover()` rebuilds its text.
The file holds private text: it never leaves the device. Message texts keep `<private>` tags (the
user's, and around answer text the client wrote from private spans), so a resumed conversation's
next prompt marks the same spans private.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from .privacy import parse_private_tags, tag_private_answer

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY, created REAL NOT NULL, target TEXT NOT NULL, drafter TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY, conversation INTEGER NOT NULL REFERENCES conversations(id),
    role TEXT NOT NULL, content TEXT NOT NULL, complete INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tokens (
    message INTEGER NOT NULL REFERENCES messages(id), position INTEGER NOT NULL,
    token INTEGER NOT NULL, source TEXT NOT NULL, PRIMARY KEY (message, position));
"""


def default_path() -> Path:
    return Path.home() / ".local/share/splitspec/chat.sqlite3"


class ChatHistory:
    """The chat history in one SQLite file (conversations, messages, each answer's token rows).

    Thread-safe: the daemon's answer worker and its HTTP threads share one connection, whose
    transaction and `lastrowid` are not per thread, so every use holds `lock` (without it, QA 58 saw
    two clients given one new conversation's id, and answers fail with "cannot commit - no
    transaction is active").

    Raises:
        ValueError: `path` cannot be opened as a history (a folder, a file that is not SQLite, a
            folder that cannot be made), named.
        sqlite3.Error: a later write fails.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.lock = threading.RLock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, check_same_thread=False)  # writes: one `with self.db` each
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(SCHEMA)
        except (sqlite3.Error, OSError) as err:
            what = "a folder" if self.path.is_dir() else f"not a usable SQLite database ({err})"
            raise ValueError(f"chat history {self.path}: {what}") from None

    def close(self) -> None:
        with self.lock:
            self.db.close()

    def new_conversation(self, target: str, drafter: str) -> int:
        with self.lock, self.db:
            return self.db.execute("INSERT INTO conversations (created, target, drafter) VALUES (?, ?, ?)",
                                   (time.time(), target, drafter)).lastrowid

    def conversations(self, limit: int = 200) -> list[dict]:
        """The newest `limit` conversations: id, created (Unix s), target, drafter, title (the first
        user message, shortened) and message count."""
        rows = self._all(
            "SELECT c.id, c.created, c.target, c.drafter, count(m.id), "
            "(SELECT content FROM messages WHERE conversation = c.id AND role = 'user' ORDER BY id LIMIT 1) "
            "FROM conversations c LEFT JOIN messages m ON m.conversation = c.id GROUP BY c.id ORDER BY c.id DESC "
            "LIMIT ?", (limit,))
        return [{"id": i, "created": created, "target": target, "drafter": drafter, "messages": count,
                 "title": _title(title or "")} for i, created, target, drafter, count, title in rows]

    def has_conversation(self, conversation: int) -> bool:
        if not -2**63 <= conversation < 2**63:  # beyond SQLite's INTEGER (it would raise OverflowError)
            return False
        return bool(self._all("SELECT 1 FROM conversations WHERE id = ?", (conversation,)))

    def last_conversation(self) -> int | None:
        """The newest conversation that holds a message (`chat --resume`), or None: one opened and
        left empty (a chat quit before its first line, a chat page's "new") is not resumed."""
        return self._all("SELECT max(conversation) FROM messages")[0][0]

    def add_message(self, conversation: int, role: str, content: str, complete: bool = True) -> int:
        with self.lock, self.db:
            return self.db.execute(
                "INSERT INTO messages (conversation, role, content, complete, created) VALUES (?, ?, ?, ?, ?)",
                (conversation, role, content, int(complete), time.time())).lastrowid

    def messages(self, conversation: int) -> list[dict]:
        rows = self._all("SELECT id, role, content, complete FROM messages WHERE conversation = ? ORDER BY id",
                         (conversation,))
        return [{"id": i, "role": r, "content": c, "complete": bool(done)} for i, r, c, done in rows]

    def answer_writer(self, message: int) -> "AnswerWriter":
        return AnswerWriter(self, message)

    def tokens(self, message: int) -> list[tuple[int, str]]:
        return self._all("SELECT token, source FROM tokens WHERE message = ? ORDER BY position", (message,))

    def finish(self, message: int, content: str, complete: bool = True) -> None:
        """Store an answer's text; `complete` False: it was cut short (cancelled, failed)."""
        with self.lock, self.db:
            self.db.execute("UPDATE messages SET content = ?, complete = ? WHERE id = ?",
                            (content, int(complete), message))

    def _all(self, sql: str, params: tuple = ()) -> list[tuple]:
        """The rows of one query, read under the lock."""
        with self.lock:
            return self.db.execute(sql, params).fetchall()

    def recover(self, message: int, tokenizer) -> str:
        """The text of an interrupted answer from its committed token rows, with `<private>` tags
        around what the client wrote from private spans (as `finish` stores a complete answer)."""
        rows = self.tokens(message)
        return tag_private_answer(tokenizer, [t for t, _ in rows], [s for _, s in rows])


class AnswerWriter:
    """A StreamEvent consumer that mirrors the answer into the `tokens` table."""

    def __init__(self, history: ChatHistory, message: int) -> None:
        self.db, self.lock, self.message = history.db, history.lock, message

    def __call__(self, event) -> None:
        with self.lock, self.db:  # one transaction per event
            if event.kind == "tokens":
                self.db.executemany("INSERT INTO tokens (message, position, token, source) VALUES (?, ?, ?, ?)",
                                    [(self.message, event.start + i, t, event.source) for i, t in enumerate(event.tokens)])
            elif event.kind == "retract":
                self.db.execute("DELETE FROM tokens WHERE message = ? AND position >= ?", (self.message, event.start))
            else:  # verified / kept
                self.db.execute("UPDATE tokens SET source = ? WHERE message = ? AND position >= ? AND position < ?",
                                (str(event.relabelled_to), self.message, event.start, event.start + event.count))


def _title(text: str, width: int = 80) -> str:
    """A conversation's title: its first user message, private spans shown as "[private]" (a list
    of conversations is no place for them, nor for a tag cut in half), shortened to `width`."""
    parts = parse_private_tags(text, strict=False)  # fails closed on a stray tag
    return "".join("[private]" if part.private else part.text for part in parts)[:width]
