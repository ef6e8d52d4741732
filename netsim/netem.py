"""The `netem` backend: two network namespaces joined by a veth pair, a netem qdisc on each end.

    ss-cli-<pid>-<k>: ssveth0 10.78.0.1/24  <== veth ==>  ss-srv-<pid>-<k>: ssveth1 10.78.0.2/24
                      root qdisc netem (up)                                  root qdisc netem (down)

Each end's egress qdisc applies the profile to the packets leaving that side, so each direction
gets the profile once (one-way delay per direction, as netsim/profiles.py states). TSO, GSO and
GRO are switched off on both ends so that netem sees the packets TCP would put on a wire.

The qdisc is configured with the `tc` command, since pyroute2's netem lacks delay distributions
(`distribution normal|pareto`, tables shipped with iproute2); without `tc`, pyroute2 sets uniform
jitter only and a profile asking for another distribution is refused. `cut()` changes both qdiscs
to 100% loss, `restore()` back to the profile.

netem's limit counts every packet it holds, those waiting out their delay included, so the limit is
the profile's queue plus the packets in flight at the link's rate during the longest delay.
This needs a kernel with sch_netem; `probe_backends()` says whether this one has it.
"""
from __future__ import annotations

import math
import shutil
import subprocess

from .backends import NamespacedLink
from .namespaces import create_netns, iproute_in, remove_stale_namespaces
from .profiles import LinkProfile
from .tun import disable_offloads

CLIENT_DEVICE, SERVER_DEVICE = "ssveth0", "ssveth1"
CLIENT_ADDRESS, SERVER_ADDRESS = "10.78.0.1", "10.78.0.2"
PACKET_BYTES = 1514  # a full Ethernet frame, to turn the queue's KiB into netem's packet limit
TC_DISTRIBUTIONS = {"normal": "normal", "pareto": "pareto", "uniform": None}  # None: netem's default


def netem_limit(profile: LinkProfile) -> int:
    """netem's packet limit for `profile`: the bottleneck queue plus the packets in flight."""
    queue = math.ceil(profile.queue_kib * 1024 / PACKET_BYTES)
    if profile.rate_mbit is None:
        return max(1000, queue)
    longest_delay_s = (profile.delay_ms + 4 * profile.jitter_ms) / 1e3
    in_flight = math.ceil(profile.rate_mbit * 1e6 / 8 * longest_delay_s / PACKET_BYTES)
    return queue + in_flight + 16


def netem_tc_args(profile: LinkProfile, cut: bool = False) -> list[str]:
    """The `tc qdisc ... netem` options for `profile` (loss 100% when `cut`), e.g.
    ["netem", "limit", "215", "delay", "21ms", "19ms", "distribution", "normal", "loss", "0.1%",
    "rate", "20mbit"]."""
    args = ["netem", "limit", str(netem_limit(profile))]
    if profile.delay_ms or profile.jitter_ms:
        args += ["delay", f"{profile.delay_ms:g}ms"]
        if profile.jitter_ms:
            args.append(f"{profile.jitter_ms:g}ms")
            distribution = TC_DISTRIBUTIONS[profile.distribution]
            if distribution:
                args += ["distribution", distribution]
    loss = 100.0 if cut else profile.loss_pct
    if loss:
        args += ["loss", f"{loss:g}%"]
    if profile.reorder_pct:
        if not profile.delay_ms:
            raise ValueError("netem reorders only delayed packets: set delay_ms with reorder_pct")
        args += ["reorder", f"{profile.reorder_pct:g}%"]
    if profile.rate_mbit is not None:
        args += ["rate", f"{profile.rate_mbit:g}mbit"]
    return args


def netem_pyroute2_kwargs(profile: LinkProfile, cut: bool = False) -> dict:
    """The same qdisc as pyroute2 `IPRoute.tc("add", "netem", index, **kwargs)` options (uniform
    jitter only). Raises ValueError for a profile with jitter of another distribution."""
    if profile.jitter_ms and profile.distribution != "uniform":
        raise ValueError(f"pyroute2's netem has no {profile.distribution} delay distribution; "
                         "install iproute2 (the `tc` command) or use distribution = \"uniform\"")
    kwargs = {"limit": netem_limit(profile), "delay": int(profile.delay_ms * 1e3),
              "jitter": int(profile.jitter_ms * 1e3), "loss": 100.0 if cut else profile.loss_pct}
    if profile.reorder_pct:
        kwargs["prob_reorder"] = profile.reorder_pct
    if profile.rate_mbit is not None:
        kwargs["rate"] = f"{profile.rate_mbit:g}mbit"
    return kwargs


class NetemBackend(NamespacedLink):
    """Two namespaces joined by a veth pair with a netem qdisc on each end (root, sch_netem)."""

    backend = "netem"
    server_address = SERVER_ADDRESS

    def __init__(self, profile: LinkProfile) -> None:
        super().__init__(profile)
        self.use_tc = shutil.which("tc") is not None
        if not self.use_tc:
            netem_pyroute2_kwargs(profile)  # refuse a distribution pyroute2 cannot set, before building

    def _ends(self) -> tuple[tuple[str, str, str], ...]:
        return ((self.client_ns, CLIENT_DEVICE, CLIENT_ADDRESS), (self.server_ns, SERVER_DEVICE, SERVER_ADDRESS))

    def _start(self) -> None:
        remove_stale_namespaces()
        for namespace in (self.client_ns, self.server_ns):
            create_netns(namespace)
            self._created.append(namespace)
        with iproute_in(self.client_ns) as ipr:
            ipr.link("add", ifname=CLIENT_DEVICE, kind="veth",
                     peer={"ifname": SERVER_DEVICE, "net_ns_fd": self.server_ns})
        for namespace, device, address in self._ends():
            with iproute_in(namespace) as ipr:
                (lo,) = ipr.link_lookup(ifname="lo")
                ipr.link("set", index=lo, state="up")
                (index,) = ipr.link_lookup(ifname=device)
                ipr.addr("add", index=index, address=address, prefixlen=24)
                ipr.link("set", index=index, state="up")
            disable_offloads(namespace, device)
            self._qdisc(namespace, device, "add", cut=False)

    def _qdisc(self, namespace: str, device: str, action: str, cut: bool) -> None:
        if self.use_tc:
            command = ["tc", "-netns", namespace, "qdisc", action, "dev", device, "root",
                       *netem_tc_args(self.profile, cut)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
            return
        with iproute_in(namespace) as ipr:
            (index,) = ipr.link_lookup(ifname=device)
            ipr.tc(action, "netem", index, **netem_pyroute2_kwargs(self.profile, cut))

    def _stop(self) -> None:
        self._remove_namespaces()  # the veth pair and its qdiscs go with them

    def _set_cut(self, cut: bool) -> None:
        for namespace, device, _ in self._ends():
            self._qdisc(namespace, device, "change", cut)

    def stats(self) -> dict:
        """Each end's qdisc counters as `tc -s` reports them (sent bytes/packets, drops)."""
        out = {}
        for side, (namespace, device, _) in zip(("up", "down"), self._ends()):
            with iproute_in(namespace) as ipr:
                (index,) = ipr.link_lookup(ifname=device)
                for msg in ipr.get_qdiscs(index=index):
                    if msg.get_attr("TCA_KIND") == "netem":
                        basic = msg.get_attr("TCA_STATS2").get_attr("TCA_STATS_BASIC")
                        queue = msg.get_attr("TCA_STATS2").get_attr("TCA_STATS_QUEUE")
                        out[side] = {"bytes": basic["bytes"], "packets": basic["packets"], "drops": queue["drops"]}
        return out
