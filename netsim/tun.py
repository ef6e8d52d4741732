"""The `tun` backend: two network namespaces, a TUN device in each, a packet emulator between them.

    ss-cli-<pid>-<k>                     root namespace                    ss-srv-<pid>-<k>
    10.77.0.1/24 on sstun0  <-- fd -->  emulator process  <-- fd -->  10.77.0.2/24 on sstun0

Each namespace routes 10.77.0.0/24 to its TUN device, so a packet a client sends to 10.77.0.2 is
read by the emulator from the client device's fd and, after the profile's loss / bottleneck / delay
(netsim/emulator.py), written to the server device's fd, where the server's kernel receives it; the
replies go the other way. Both ends are real kernel TCP stacks: a dropped packet is retransmitted
by TCP after its own timers, and congestion control reacts to the bottleneck and to the losses.
The addresses are the same for every link, since each link's namespaces are its own.

The TUN devices are opened without IFF_VNET_HDR, so the kernel hands them whole packets of at most
the MTU (1500): no segmentation offload reaches the emulator; GRO/TSO/GSO are also switched off on
the devices. IPv6 is disabled in both namespaces so that no neighbour discovery crosses the link.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import subprocess
import sys

from .backends import NamespacedLink, _terminate
from .control import ask
from .namespaces import create_netns, in_netns, iproute_in, remove_stale_namespaces, write_sysctl
from .profiles import LinkProfile

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
DEVICE = "sstun0"
SUBNET = "10.77.0.0/24"
CLIENT_ADDRESS, SERVER_ADDRESS = "10.77.0.1", "10.77.0.2"
MTU = 1500
OFFLOADS = ("tx-tcp-segmentation", "tx-tcp6-segmentation", "tx-generic-segmentation", "rx-gro")


def open_tun(namespace: str, name: str = DEVICE) -> int:
    """Create TUN device `name` inside `namespace`; its non-blocking fd (raw IP packets, no header).

    Raises:
        OSError: /dev/net/tun missing or no privilege.
    """
    with in_netns(namespace):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
        except OSError:
            os.close(fd)
            raise
    return fd


def configure_interface(namespace: str, ifname: str, address: str, prefixlen: int = 24, mtu: int = MTU) -> None:
    """Bring up `lo` and `ifname` in `namespace` with `address`/`prefixlen`, offloads off, no IPv6."""
    write_sysctl(namespace, "net/ipv6/conf/all/disable_ipv6", "1")
    write_sysctl(namespace, "net/ipv6/conf/default/disable_ipv6", "1")
    with iproute_in(namespace) as ipr:
        (lo,) = ipr.link_lookup(ifname="lo")
        ipr.link("set", index=lo, state="up")
        (index,) = ipr.link_lookup(ifname=ifname)
        ipr.link("set", index=index, mtu=mtu)
        ipr.addr("add", index=index, address=address, prefixlen=prefixlen)
        ipr.link("set", index=index, state="up")
    disable_offloads(namespace, ifname)


def disable_offloads(namespace: str, ifname: str) -> list[str]:
    """Switch TSO/GSO/GRO off on `ifname` (pyroute2's ethtool ioctls); the features turned off.

    Best effort: a device that does not offer a feature keeps it as it is."""
    from pyroute2.ethtool import Ethtool

    changed = []
    with in_netns(namespace), Ethtool() as ethtool:
        features = ethtool.get_features(ifname)
        for name in OFFLOADS:
            feature = features.features.get(name)
            if feature is not None and feature.enable and feature.available:
                feature.enable = False
                changed.append(name)
        if changed:
            ethtool.set_features(ifname, features)
    return changed


class TunBackend(NamespacedLink):
    """Two namespaces with a TUN device each and the packet emulator between them (needs root)."""

    backend = "tun"
    server_address = SERVER_ADDRESS

    def __init__(self, profile: LinkProfile) -> None:
        super().__init__(profile)
        self.emulator: subprocess.Popen | None = None

    def _start(self) -> None:
        remove_stale_namespaces()
        fds = []
        try:
            for namespace, address in ((self.client_ns, CLIENT_ADDRESS), (self.server_ns, SERVER_ADDRESS)):
                create_netns(namespace)
                self._created.append(namespace)
                fds.append(open_tun(namespace))
                configure_interface(namespace, DEVICE, address)
            self.emulator = subprocess.Popen(
                [sys.executable, "-m", "splitspec.netsim.emulator", "--profile", json.dumps(self.profile.to_dict()),
                 "--client-fd", str(fds[0]), "--server-fd", str(fds[1])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=fds, text=True, bufsize=1)
        finally:
            for fd in fds:  # the emulator holds its own copies; the devices live as long as it does
                os.close(fd)
        ready = self.emulator.stdout.readline()
        if not ready.startswith('{"ready"'):
            raise RuntimeError(f"the packet emulator did not start (exit {self.emulator.poll()}): {ready!r}")

    def _stop(self) -> None:
        if self.emulator is not None:
            with contextlib.suppress(OSError):
                self.emulator.stdin.close()  # EOF: the emulator exits
            _terminate(self.emulator, grace_s=2.0)
            self.emulator.stdout.close()
            self.emulator = None
        self._remove_namespaces()

    def _ask(self, command: str) -> dict:
        if self.emulator is None or self.emulator.poll() is not None:
            raise RuntimeError("the packet emulator is not running")
        return ask(self.emulator, self._lock, command)

    def _set_cut(self, cut: bool) -> None:
        self._ask("cut" if cut else "restore")

    def stats(self) -> dict:
        """Per direction ("up" = client to server): packets, bytes, delivered, lost, tail_dropped,
        cut_dropped, reordered; and packets now in flight."""
        return self._ask("stats")
