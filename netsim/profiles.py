"""Link profiles: what an emulated network link does to the packets (or bytes) crossing it.

Convention: `delay_ms` and `jitter_ms` apply to EACH direction independently, so an idle round
trip takes about 2 x delay_ms. The seed paper's settings (seed 001, §4.2: tc-netem on Linux, 4G =
20 Mbit/s, 21 +/- 19 ms, 0.1% loss; 5G = 10 +/- 10 ms, 0.1% loss, over a ~50 Mbit/s base link)
are applied by the presets to each direction, as a netem qdisc on both ends of a veth pair does.
"""
from __future__ import annotations

import math
import random
import tomllib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

DISTRIBUTIONS = ("normal", "uniform", "pareto")


@dataclass(frozen=True)
class LinkProfile:
    """One direction's behaviour (both directions use the same profile).

    delay_ms: mean one-way delay; jitter_ms: its spread (normal: standard deviation; uniform: half
    width; pareto: scale of a heavy right tail); loss_pct: packet / chunk loss in percent;
    rate_mbit: bottleneck rate (None or inf = unlimited, stored as None); queue_kib: bottleneck
    queue; reorder_pct: share of packets sent without delay (netem's reorder); seed: for every
    random draw. `offline` (loss_pct 100): every backend black-holes the link, as `Link.cut()` does.

    Raises:
        ValueError: a field of the wrong type (a string, a bool, a float seed), a non-finite number
            (NaN, inf; only rate_mbit may be inf), or a value out of range. The message names the field.
    """

    name: str
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    distribution: str = "normal"
    loss_pct: float = 0.0
    rate_mbit: float | None = None
    queue_kib: int = 256
    reorder_pct: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {self.name!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if _is_number(self.rate_mbit) and self.rate_mbit == math.inf:
            object.__setattr__(self, "rate_mbit", None)  # unlimited
        for field in ("delay_ms", "jitter_ms", "loss_pct", "rate_mbit", "queue_kib", "reorder_pct"):
            value = getattr(self, field)
            if not (field == "rate_mbit" and value is None) and not (_is_number(value) and math.isfinite(value)):
                raise ValueError(f"{field} must be a finite number, got {value!r}")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {self.distribution!r}")
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.queue_kib <= 0:
            raise ValueError(f"delay, jitter must be >= 0 and the queue > 0: {self}")
        if not 0 <= self.loss_pct <= 100 or not 0 <= self.reorder_pct <= 100:
            raise ValueError(f"loss and reorder are percentages in [0, 100]: {self}")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"rate must be > 0 Mbit/s or None: {self}")

    @property
    def offline(self) -> bool:
        """Whether nothing crosses the link (loss 100%): the backends treat it as a cut."""
        return self.loss_pct >= 100

    @property
    def rtt_ms(self) -> float:
        """Mean idle round trip (both directions' mean delay)."""
        return 2 * self.delay_ms

    def sample_delay_ms(self, rng: random.Random) -> float:
        """One packet's one-way delay, never negative."""
        if not self.jitter_ms:
            return self.delay_ms
        if self.distribution == "normal":
            return max(0.0, rng.gauss(self.delay_ms, self.jitter_ms))
        if self.distribution == "uniform":
            return max(0.0, self.delay_ms + rng.uniform(-self.jitter_ms, self.jitter_ms))
        # a heavy right tail; mean delay_ms while jitter_ms <= 2 * delay_ms (nothing to clamp), above it
        # the clamp lifts it (unclamped, jitter 20 over delay 1 drew -9 ms: QA 56)
        return max(0.0, self.delay_ms + self.jitter_ms * (rng.paretovariate(3.0) - 1.5))

    def serialization_ms(self, nbytes: int) -> float:
        """Time the bottleneck needs to send `nbytes`."""
        return 0.0 if self.rate_mbit is None else nbytes * 8 / (self.rate_mbit * 1e3)

    def with_seed(self, seed: int) -> "LinkProfile":
        return replace(self, seed=seed)

    def to_dict(self) -> dict:
        return asdict(self)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


PRESETS = {
    "lan": LinkProfile("lan", delay_ms=0.25, jitter_ms=0.05, rate_mbit=1000.0),
    "wifi": LinkProfile("wifi", delay_ms=3.0, jitter_ms=2.0, loss_pct=0.05, rate_mbit=100.0),
    "5g": LinkProfile("5g", delay_ms=10.0, jitter_ms=10.0, loss_pct=0.1, rate_mbit=50.0),
    "4g": LinkProfile("4g", delay_ms=21.0, jitter_ms=19.0, loss_pct=0.1, rate_mbit=20.0),
    "offline": LinkProfile("offline", loss_pct=100.0),
}


def load_profile(spec: str) -> LinkProfile:
    """A preset name, or a TOML file with the LinkProfile fields at top level or under [link].

    Raises:
        ValueError: unknown preset, not TOML, unknown keys, a `link` that is no table or keys beside
            it, or invalid values (see LinkProfile).
        FileNotFoundError: the TOML file does not exist.
    """
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.suffix == ".toml":
        raise ValueError(f"unknown link profile {spec!r}; presets: {', '.join(PRESETS)}, or a .toml file")
    data = tomllib.loads(path.read_text())
    if "link" in data:
        if not isinstance(data["link"], dict):
            raise ValueError(f"{path}: `link` must be a table ([link]) of the profile's fields")
        if len(data) > 1:  # they would be ignored without a word
            raise ValueError(f"{path}: keys beside [link]: {sorted(set(data) - {'link'})}; put them under [link]")
        data = data["link"]
    fields = set(LinkProfile.__dataclass_fields__)
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; expected some of {sorted(fields)}")
    data.setdefault("name", path.stem)
    try:
        return LinkProfile(**data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
