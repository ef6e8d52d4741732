"""Link cuts on a schedule, for the offline experiments: "the link drops 50 s in, for 10 s".

A `CutSchedule` is a sorted list of non-overlapping outages (at_s, duration_s), seconds from the
moment the schedule starts. Text form: comma-separated `AT:DURATION` items, each a number with an
optional unit `ms`, `s` (the default) or `m`, e.g. "50s:10s,120:5,2m:500ms".
`ScheduledCuts(link, schedule)` runs it against any backend's `cut()` / `restore()` on a thread.
`ProfileSwitching` ("4g~lan/10s") and `ScheduledSwitches` alternate a relay link's profile instead.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)?\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}


def parse_duration_s(text: str) -> float:
    """Seconds in "250ms", "1.5s", "2m" or a bare number of seconds.

    Raises:
        ValueError: not a non-negative number with one of those units.
    """
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (examples: 500ms, 10s, 10, 2m)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


@dataclass(frozen=True)
class CutSchedule:
    """Outages as (at_s, duration_s) pairs: sorted by start, each duration > 0, none overlapping."""

    cuts: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        end = 0.0
        for at_s, duration_s in self.cuts:
            if at_s < 0 or duration_s <= 0:
                raise ValueError(f"a cut starts at >= 0 s and lasts > 0 s, got ({at_s}, {duration_s})")
            if at_s < end:
                raise ValueError(f"cuts must be sorted and must not overlap: {self.cuts}")
            end = at_s + duration_s

    @classmethod
    def parse(cls, spec: str | None) -> "CutSchedule":
        """From "AT:DURATION,..." (see the module docstring); None or "" is no cut.

        Raises:
            ValueError: a malformed item, or cuts out of order or overlapping.
        """
        if not spec or not spec.strip():
            return cls()
        cuts = []
        for item in spec.split(","):
            parts = item.split(":")
            if len(parts) != 2:
                raise ValueError(f"a cut is AT:DURATION, got {item!r}")
            cuts.append((parse_duration_s(parts[0]), parse_duration_s(parts[1])))
        return cls(tuple(cuts))

    @classmethod
    def of(cls, cuts) -> "CutSchedule":
        """From an iterable of (at_s, duration_s), sorted here."""
        return cls(tuple(sorted((float(a), float(d)) for a, d in cuts)))

    def is_cut(self, t_s: float) -> bool:
        """Whether the link is down `t_s` seconds after the schedule started."""
        return any(at <= t_s < at + d for at, d in self.cuts)

    def transitions(self) -> list[tuple[float, bool]]:
        """(t_s, cut) pairs in time order: True = cut at t_s, False = restore at t_s."""
        out = []
        for at_s, duration_s in self.cuts:
            out += [(at_s, True), (at_s + duration_s, False)]
        return out

    def __str__(self) -> str:
        return ",".join(f"{at:g}s:{d:g}s" for at, d in self.cuts)


class ScheduledCuts:
    """Applies a CutSchedule to a link (anything with cut() and restore()) on a daemon thread.

    The clock starts at `start()`; `stop()` cancels the rest and leaves the link restored.
    `log` holds (t_s, "cut" | "restore") as applied, t_s measured from start.
    """

    def __init__(self, link, schedule: CutSchedule, clock=time.monotonic) -> None:
        self.link, self.schedule, self.clock = link, schedule, clock
        self.log: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="netsim-cuts")
        self.t0 = 0.0

    def start(self) -> "ScheduledCuts":
        self.t0 = self.clock()
        self._thread.start()
        return self

    def _run(self) -> None:
        for t_s, cut in self.schedule.transitions():
            if self._stop.wait(max(0.0, self.t0 + t_s - self.clock())):
                return
            self.link.cut() if cut else self.link.restore()
            self.log.append((self.clock() - self.t0, "cut" if cut else "restore"))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.log and self.log[-1][1] == "cut":
            self.link.restore()
            self.log.append((self.clock() - self.t0, "restore"))

    def __enter__(self) -> "ScheduledCuts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(frozen=True)
class ProfileSwitching:
    """A link that alternates between profiles every `period_s` (a phone moving between 4G and
    Wi-Fi). Text form: `A~B[~C...]/PERIOD`, e.g. "4g~lan/10s": 4g for 10 s, lan for 10 s, 4g, ...

    Raises:
        ValueError: fewer than two profiles, or a period that is not > 0.
    """

    names: tuple[str, ...]
    period_s: float

    def __post_init__(self) -> None:
        if len(self.names) < 2 or self.period_s <= 0:
            raise ValueError(f"a switching link needs two or more profiles and a period > 0: {self}")

    @classmethod
    def parse(cls, spec: str) -> "ProfileSwitching | None":
        """The switching of "A~B/PERIOD", or None for a spec without `~` (a single profile)."""
        if "~" not in spec:
            return None
        names, _, period = spec.partition("/")
        if not period:
            raise ValueError(f"a switching link is A~B/PERIOD (e.g. 4g~lan/10s), got {spec!r}")
        return cls(tuple(n.strip() for n in names.split("~")), parse_duration_s(period))

    @property
    def name(self) -> str:
        return "~".join(self.names) + f"/{self.period_s:g}s"


class ScheduledSwitches:
    """Applies a ProfileSwitching to a link (anything with `set_profile(profile)`) on a daemon
    thread, from `start()`; `profiles` are the LinkProfiles of `switching.names`, in order.
    `restart()` begins the sequence again from the first profile (a benchmark anchors it to each
    answer, so every method meets the same changes at the same moments). `log` holds (t_s,
    profile name) as applied, t_s from the latest (re)start."""

    def __init__(self, link, switching: ProfileSwitching, profiles, clock=time.monotonic) -> None:
        self.link, self.switching, self.profiles, self.clock = link, switching, list(profiles), clock
        self.log: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = 0.0

    def start(self) -> "ScheduledSwitches":
        self._stop = threading.Event()
        self.t0 = self.clock()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), daemon=True, name="netsim-switches")
        self._thread.start()
        return self

    def restart(self) -> None:
        """Back to the first profile now, the next switch one period from now."""
        self.stop()
        self.link.set_profile(self.profiles[0])
        self.log.append((0.0, self.profiles[0].name))
        self.start()

    def _run(self, stop: threading.Event) -> None:
        turn = 1
        while not stop.wait(max(0.0, self.t0 + turn * self.switching.period_s - self.clock())):
            profile = self.profiles[turn % len(self.profiles)]
            self.link.set_profile(profile)
            self.log.append((self.clock() - self.t0, profile.name))
            turn += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)

    def __enter__(self) -> "ScheduledSwitches":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
