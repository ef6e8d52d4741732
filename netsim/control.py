"""The control channel of a link's child process (the relay process, the tun packet emulator).

The parent writes one command per line on the child's stdin — `cut`, `restore`, `stats` or (the
relay) `profile {...}` — and
reads one JSON line answering it from the child's stdout; EOF on stdin stops the child.
"""
from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable


def answer(command: str, set_cut: Callable[[bool], None], stats: Callable[[], dict],
           set_profile: Callable[[dict], None] | None = None) -> str:
    """The child's side: carry out one command line and return its JSON reply line (no newline).
    `profile <LinkProfile fields as JSON>` switches the link's profile where `set_profile` is given."""
    if command in ("cut", "restore"):
        set_cut(command == "cut")
        reply = {"ok": command}
    elif command == "stats":
        reply = stats()
    elif command.startswith("profile ") and set_profile is not None:
        try:
            set_profile(json.loads(command.removeprefix("profile ")))
            reply = {"ok": "profile"}
        except (ValueError, TypeError) as err:
            reply = {"error": f"bad profile: {err}"}
    else:
        reply = {"error": f"unknown command {command!r}"}
    return json.dumps(reply)


def ask(proc: subprocess.Popen, lock: threading.Lock, command: str) -> dict:
    """The parent's side: send `command` to a child started with text pipes, return its reply.

    Raises:
        json.JSONDecodeError: the child answered something else (or exited: an empty line).
    """
    with lock:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())
