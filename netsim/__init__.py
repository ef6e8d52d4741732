"""splitspec.netsim: link profiles (4G, 5G, ...) and the backends that emulate them.

- profiles.py: `LinkProfile` (one-way delay per direction, jitter, loss, rate, queue, reorder, seed),
  the presets and TOML profiles.
- backends.py: the `Link` interface every backend implements, the capability probe
  (`probe_backends`, `available_backends`, `choose_backend`) and `make_link`.
- relay.py: `relay`, an unprivileged asyncio TCP relay (loss as a retransmission stall).
- tun.py + emulator.py: `tun`, a user-space packet emulator between two network namespaces over
  TUN devices; the kernel TCP stacks see real delay, drops and retransmissions (root).
- netem.py: `netem`, two namespaces joined by a veth pair with a netem qdisc on each end (root and a
  kernel with sch_netem).
- schedule.py: link cuts on a schedule (`CutSchedule`, `ScheduledCuts`), for offline experiments.
- validate.py: echo / bulk / gRPC probes that check backends against each other and the profile.
- cli.py: `splitspec netsim probe | run | validate | cleanup`, and `serve --link --backend`.
"""
from .backends import (BACKENDS, BackendStatus, Link, RelayBackend, available_backends, choose_backend, make_link,
                       probe_backends)
from .profiles import PRESETS, LinkProfile, load_profile
from .relay import RelayLink, RelayThread
from .schedule import CutSchedule, ScheduledCuts

__all__ = ["BACKENDS", "BackendStatus", "CutSchedule", "Link", "LinkProfile", "PRESETS", "RelayBackend",
           "RelayLink", "RelayThread", "ScheduledCuts", "available_backends", "choose_backend", "load_profile",
           "make_link", "probe_backends"]
