"""A run clock that does not count the time a training run spent suspended.

Long CPU runs share two cores with everything else, so they get paused for a benchmark now and
then. `--max-minutes` is a budget of training time: a run paused for twenty minutes should not
stop twenty minutes early with its cosine schedule cut short. The clock counts wall time minus
the time between a SIGTSTP (`kill -TSTP PID`, or Ctrl-Z) and the SIGCONT that resumes the
process. SIGSTOP cannot be caught, so a run paused with `kill -STOP` still counts the pause.
"""
from __future__ import annotations

import os
import signal
import threading
import time


class RunClock:
    """Seconds of wall time since start, less the time spent stopped by SIGTSTP.

    `install()` takes over SIGTSTP and SIGCONT (main thread only; elsewhere, or on platforms
    without job control, the clock is plain wall time) and `uninstall()` gives them back.
    """

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._paused_s = 0.0
        self._stopped_at: float | None = None
        self._previous: dict[int, object] = {}

    def elapsed(self) -> float:
        """Seconds counted so far (float, >= 0)."""
        now = time.monotonic()
        paused = self._paused_s + (now - self._stopped_at if self._stopped_at is not None else 0.0)
        return max(0.0, now - self._start - paused)

    @property
    def paused_s(self) -> float:
        """Seconds spent stopped so far."""
        return self._paused_s

    def install(self) -> "RunClock":
        if not hasattr(signal, "SIGTSTP") or threading.current_thread() is not threading.main_thread():
            return self
        for sig, handler in ((signal.SIGTSTP, self._on_tstp), (signal.SIGCONT, self._on_cont)):
            self._previous[sig] = signal.signal(sig, handler)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_tstp(self, signum, frame) -> None:
        self._stopped_at = time.monotonic()
        # stop for real with SIGSTOP: the kernel discards a SIGTSTP whose default action would stop a
        # process in an orphaned process group (any `nohup ... &` started from a script that has
        # exited), so re-raising SIGTSTP would leave such a run going while the clock counts a pause
        os.kill(os.getpid(), signal.SIGSTOP)

    def _on_cont(self, signum, frame) -> None:
        if self._stopped_at is not None:
            self._paused_s += time.monotonic() - self._stopped_at
            self._stopped_at = None
