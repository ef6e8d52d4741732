"""splitspec.netsim: link profiles (4G, 5G, ...) and emulation backends.

Backends so far: `relay` (unprivileged asyncio TCP relay). The `tun` (user-space packet emulator
between network namespaces) and `netem` (pyroute2 + sch_netem) backends are still to come.
"""
from .profiles import PRESETS, LinkProfile, load_profile
from .relay import RelayLink, RelayThread

__all__ = ["PRESETS", "LinkProfile", "load_profile", "RelayLink", "RelayThread"]
