"""What the loop does when the link goes down: the `OfflinePolicy`, and the reconnect probe that
polls the verify service on a background thread until it answers, waiting
min(max, initial * 2**attempt) * U(0, 1) s between probes (exponential backoff with full jitter)."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Callable



@dataclass(frozen=True)
class OfflinePolicy:
    """What the loop does when the verify service is unreachable.

    enabled: continue with the drafter alone (else LinkDown propagates).
    on_reconnect: "heal" (text after the first rejected offline token is replaced by the target's
      continuation) or "keep" (it stays as written).
    backoff_*: reconnect probes wait min(max, initial * 2**attempt) * U(0, 1) s (full jitter).
    final_wait_s: how long to wait for the link when the answer is complete but unverified, when
      the drafter cannot write alone, or when the first session cannot be opened (then LinkDown is
      raised).
    """

    enabled: bool = True
    on_reconnect: str = "heal"
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    final_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if self.on_reconnect not in ("heal", "keep"):
            raise ValueError(f"on_reconnect must be heal or keep, got {self.on_reconnect!r}")


class ReconnectProbe:
    """`start` begins probing with `probe()` (True: the service answers); `up` and `wait` tell the
    loop when it did; `stop` ends the thread (the link counts as up from then on)."""

    def __init__(self, probe: Callable[[], bool], initial_s: float, max_s: float) -> None:
        self.probe, self.initial_s, self.max_s = probe, initial_s, max_s
        self._up = threading.Event()

    @property
    def up(self) -> bool:
        return self._up.is_set()

    def wait(self, timeout_s: float, abandon: Callable[[], bool] | None = None) -> bool:
        """Block until the link is up or `timeout_s` passed, or (polled every 0.1 s) `abandon()` is
        true; True when it is up."""
        if abandon is None:
            return self._up.wait(timeout_s)
        deadline = time.monotonic() + timeout_s
        while not abandon():
            if self._up.wait(max(0.0, min(0.1, deadline - time.monotonic()))):
                return True
            if time.monotonic() >= deadline:
                return False
        return self._up.is_set()

    def start(self) -> None:
        self._up.clear()
        threading.Thread(target=self._probe_until_up, name="reconnect", daemon=True).start()

    def stop(self) -> None:
        self._up.set()

    def _probe_until_up(self) -> None:
        attempt = 0
        while not self._up.is_set():
            delay = min(self.max_s, self.initial_s * 2 ** attempt) * random.random()
            if self._up.wait(delay):
                return
            if self.probe():
                self._up.set()
                return
            attempt += 1
