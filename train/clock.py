"""A run clock that does not count the time a training run spent suspended.

Long CPU runs share two cores with everything else, so they get paused for a benchmark now and
then. `--max-minutes` is a budget of training time: a run paused for twenty minutes should not
stop twenty minutes early with its cosine schedule cut short. The clock counts wall time minus
the time between a SIGTSTP (`kill -TSTP PID`, or Ctrl-Z) and the SIGCONT that resumes the
process. SIGSTOP cannot be caught, so a run paused with `kill -STOP` still counts the pause.

The clock also takes a stop request: the first SIGINT (Ctrl-C) or SIGTERM (`kill PID`, a batch
scheduler's notice) only sets `stop_requested`, so the trainer finishes its step, evaluates, saves
its checkpoints and resumable state as `--max-minutes` would, and exits normally; a second one
acts as it would have without the clock (KeyboardInterrupt, or termination).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time


class RunClock:
    """Seconds of wall time since start, less the time spent stopped by SIGTSTP; and whether a
    stop was asked for (`stop_requested`, bool).

    `install()` takes over SIGTSTP and SIGCONT (main thread only; elsewhere, or on platforms
    without job control, the clock is plain wall time), SIGINT and SIGTERM (main thread only), and
    `uninstall()` gives them back.
    """

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._paused_s = 0.0
        self._stopped_at: float | None = None
        self._previous: dict[int, object] = {}
        self.stop_requested = False

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
        if threading.current_thread() is not threading.main_thread():
            return self
        handlers = [(signal.SIGINT, self._on_stop), (signal.SIGTERM, self._on_stop)]
        if hasattr(signal, "SIGTSTP"):
            handlers += [(signal.SIGTSTP, self._on_tstp), (signal.SIGCONT, self._on_cont)]
        for sig, handler in handlers:
            self._previous[sig] = signal.signal(sig, handler)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_stop(self, signum, frame) -> None:
        self.stop_requested = True
        sys.stderr.write(f"\n{signal.Signals(signum).name}: stopping after this step (evaluation, checkpoints, "
                         "state for --resume); send it again to stop at once without saving\n")
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # a second one is not caught here

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
