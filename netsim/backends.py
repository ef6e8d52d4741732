"""One interface for every emulation backend, and the probe that says which ones this host can run.

A `Link` puts a server behind an emulated network link. The server listens on `link.server_host`
(inside `link.server_side()` for sockets made in this process, or a process started with
`link.popen(argv, "server")`); `link.expose(port)` gives the "host:port" a client uses, from
`link.client_side()` or a process started with `link.popen(argv, "client")`. Every result file
should carry `link.describe()` (backend, profile, seed).

Backends (`BACKENDS`, most faithful first):
- `netem`: two network namespaces joined by a veth pair, a netem qdisc on each end (netsim/netem.py).
  Needs root and a kernel with sch_netem.
- `tun`: two namespaces, each with a TUN device, and a user-space packet emulator between them
  (netsim/tun.py, netsim/emulator.py): the kernel TCP stacks see real delay, drops and
  retransmissions. Needs root and /dev/net/tun.
- `relay`: an unprivileged asyncio TCP relay on loopback (netsim/relay.py): the server and the
  client run on this host as they are; loss is a stall, not a drop. Always available.
"""
from __future__ import annotations

import abc
import atexit
import contextlib
import functools
import os
import shutil
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from .namespaces import link_namespace_names, remove_netns
from .profiles import LinkProfile
from .relay import RelayProcess, RelayThread

BACKENDS = ("netem", "tun", "relay")
SIDES = ("client", "server")
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21

_live_links: "weakref.WeakSet[Link]" = weakref.WeakSet()


@atexit.register
def _stop_live_links() -> None:
    for link in list(_live_links):
        with contextlib.suppress(Exception):
            link.stop()


class Link(abc.ABC):
    """An emulated link between a client side and a server side; a context manager (start/stop)."""

    backend: str = ""

    def __init__(self, profile: LinkProfile) -> None:
        self.profile = profile
        self.started = False
        self.is_cut = False
        self._owner_pid = os.getpid()
        self._processes: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Link":
        """Build the link (namespaces, devices, emulator). Idempotent.

        Raises:
            OSError: no privilege, no TUN device, a namespace of the same name exists.
            RuntimeError: the emulator process or the `tc` command failed.
            Whatever was half built is removed first (see `probe_backends` for what this host lacks).
        """
        with self._lock:
            if self.started:
                return self
            self._owner_pid = os.getpid()
            try:
                self._start()
            except BaseException:
                self._stop()
                raise
            self.started = True
            _live_links.add(self)
        return self

    def stop(self) -> None:
        """Stop the processes started with `popen`, then remove everything `start` built. Idempotent.

        Does nothing in a forked copy of the process that started the link."""
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            for proc in self._processes:
                _terminate(proc)
            self._processes.clear()
            self._stop()
            self.started = False
            _live_links.discard(self)

    def __enter__(self) -> "Link":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @abc.abstractmethod
    def _start(self) -> None: ...

    @abc.abstractmethod
    def _stop(self) -> None:
        """Undo whatever part of `_start` happened; must not raise for parts never built."""

    # -- where servers listen and clients connect -----------------------------------------------
    @property
    @abc.abstractmethod
    def server_host(self) -> str:
        """The IP address a server behind this link listens on."""

    @abc.abstractmethod
    def expose(self, port: int) -> str:
        """The address ("host:port") at which clients reach a server listening on (server_host, port)."""

    @property
    def namespaces(self) -> dict[str, str | None]:
        """Network namespace of each side ("client", "server"); None = this host's own."""
        return {"client": None, "server": None}

    @contextlib.contextmanager
    def side(self, side: str) -> Iterator[None]:
        """Sockets created by this thread inside the block belong to `side` ("client" | "server")."""
        from .namespaces import in_netns

        with in_netns(self.namespaces[_check_side(side)]):
            yield

    def server_side(self):
        return self.side("server")

    def client_side(self):
        return self.side("client")

    def command(self, argv: list[str], side: str) -> list[str]:
        """`argv` wrapped to run on `side` (inside its namespace, if it has one)."""
        from .namespaces import netns_command

        return netns_command(self.namespaces[_check_side(side)], argv)

    def popen(self, argv: list[str], side: str, **kwargs) -> subprocess.Popen:
        """Start `argv` on `side`; it is terminated by `stop()` if still running then."""
        if not self.started:
            raise RuntimeError("start the link before running commands behind it")
        proc = subprocess.Popen(self.command(argv, side), **kwargs)
        self._processes.append(proc)
        return proc

    def client_hint(self, argv: list[str]) -> str:
        """A shell line a person can paste to run `argv` on the client side."""
        import shlex

        ns = self.namespaces["client"]
        if ns is None:
            return shlex.join(argv)
        if shutil.which("ip"):
            return shlex.join(["ip", "netns", "exec", ns, *argv])
        return shlex.join(self.command(argv, "client"))

    # -- link state -------------------------------------------------------------------------------
    def cut(self) -> None:
        """Black-hole both directions until `restore()`. tun and netem drop every packet (TCP
        retransmits on its backoff timer, so traffic resumes up to one RTO after the restore); the
        relay holds the bytes and closes, and leaves new connections unanswered, until the restore.
        An offline profile (loss 100%) does the same for as long as it is the link's profile."""
        self._set_cut(True)
        self.is_cut = True

    def restore(self) -> None:
        self._set_cut(False)
        self.is_cut = False

    @abc.abstractmethod
    def _set_cut(self, cut: bool) -> None: ...

    def stats(self) -> dict:
        """Backend-specific counters (packets, bytes, drops); empty when the backend keeps none."""
        return {}

    def describe(self) -> dict:
        """What a result file records about the link: backend, profile name, seed, every profile
        field, and the namespaces (None for the host's own)."""
        return {"backend": self.backend, "profile": self.profile.name, "seed": self.profile.seed,
                "link": self.profile.to_dict(), "namespaces": self.namespaces}


class NamespacedLink(Link):
    """A link between two network namespaces of its own (the `tun` and `netem` backends): the server
    side listens on `server_address` inside the server namespace. Subclasses create the namespaces
    in `_start` (recording each in `_created`) and remove them with `_remove_namespaces`."""

    server_address: str = ""

    def __init__(self, profile: LinkProfile) -> None:
        super().__init__(profile)
        self.client_ns, self.server_ns = link_namespace_names()
        self._created: list[str] = []

    @property
    def namespaces(self) -> dict[str, str | None]:
        return {"client": self.client_ns, "server": self.server_ns}

    @property
    def server_host(self) -> str:
        return self.server_address

    def expose(self, port: int) -> str:
        return f"{self.server_address}:{port}"

    def _remove_namespaces(self) -> None:
        """Remove the namespaces created so far (devices and qdiscs inside go with them)."""
        for namespace in reversed(self._created):
            remove_netns(namespace)
        self._created.clear()


def _check_side(side: str) -> str:
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    return side


def _terminate(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RelayBackend(Link):
    """The unprivileged relay: both sides are this host; `expose(port)` starts one relay per port.

    `expose(port, listen_port)` may choose the port clients use (default: any free one).
    `own_process`: run each relay in a child process (RelayProcess) rather than on a thread here,
    so that the caller's Python threads cannot delay it (what `validate` uses)."""

    backend = "relay"

    def __init__(self, profile: LinkProfile, listen_host: str = "127.0.0.1", own_process: bool = False) -> None:
        super().__init__(profile)
        self.listen_host, self.own_process = listen_host, own_process
        self.relays: dict[int, RelayThread | RelayProcess] = {}

    @property
    def server_host(self) -> str:
        return "127.0.0.1"

    def _start(self) -> None:
        pass

    def _stop(self) -> None:
        for relay in self.relays.values():
            relay.stop()
        self.relays.clear()

    def expose(self, port: int, listen_port: int = 0) -> str:
        if not self.started:
            raise RuntimeError("start the link before exposing a port")
        if port not in self.relays:
            kind = RelayProcess if self.own_process else RelayThread
            relay = kind(self.profile, (self.server_host, port), (self.listen_host, listen_port))
            if self.is_cut:
                relay.cut()
            self.relays[port] = relay
        return self.relays[port].address

    def _set_cut(self, cut: bool) -> None:
        for relay in self.relays.values():
            relay.cut() if cut else relay.restore()

    def set_profile(self, profile: LinkProfile) -> None:
        """Switch every exposed relay (and later ones) to `profile`, open connections included."""
        self.profile = profile
        for relay in self.relays.values():
            relay.set_profile(profile)

    def stats(self) -> dict:
        """Payload bytes relayed, all exposed ports together: bytes_up (client to server), bytes_down."""
        counts = [relay.stats() for relay in self.relays.values()]
        return {key: sum(c[key] for c in counts) for key in ("bytes_up", "bytes_down")}


# -- capability probe ----------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can run on this host; `reason` says why not, or notes a limitation."""

    name: str
    available: bool
    reason: str = ""


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def _privilege_problem() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"needs Linux network namespaces (this is {sys.platform})"
    caps = _effective_caps()
    missing = [name for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not caps >> bit & 1]
    if missing:
        who = "not root" if os.geteuid() != 0 else "root without " + " and ".join(missing)
        return f"{who}: needs {' and '.join(missing)} to create network namespaces (run as root / sudo)"
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "pyroute2 is not installed (pip install pyroute2)"
    return None


def _tun_problem() -> str | None:
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (modprobe tun; in a container pass --device /dev/net/tun)"
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as err:
        return f"cannot open /dev/net/tun: {err.strerror}"
    return None


def _netem_problem(namespace: str) -> str | None:
    """Try a netem qdisc on the loopback of a scratch namespace."""
    from pyroute2.netlink.exceptions import NetlinkError

    from .namespaces import iproute_in

    with iproute_in(namespace) as ipr:
        lo = ipr.link_lookup(ifname="lo")[0]
        try:
            ipr.tc("add", "netem", lo, delay=1000)
        except NetlinkError as err:
            if err.code == 2:  # ENOENT: what tc reports as "Specified qdisc kind is unknown"
                return ("sch_netem is not in this kernel (tc: \"Specified qdisc kind is unknown\"; "
                        "modprobe sch_netem, or install the kernel's extra modules)")
            return f"adding a netem qdisc failed: {err}"
    return None


@functools.lru_cache(maxsize=1)
def probe_backends() -> dict[str, BackendStatus]:
    """Which backends this host can run, and why not; cached for the process (`.cache_clear()`).

    Creates and removes one scratch namespace when privileged (a few tens of ms)."""
    status = {"relay": BackendStatus("relay", True, "unprivileged TCP relay; loss is a stall, not a drop")}
    problem = _privilege_problem()
    if problem:
        return {"netem": BackendStatus("netem", False, problem), "tun": BackendStatus("tun", False, problem),
                **status}
    tun = _tun_problem()
    status["tun"] = BackendStatus("tun", tun is None, tun or "user-space packet emulator over TUN in two namespaces")
    from .namespaces import create_netns, remove_netns

    scratch = f"ss-probe-{os.getpid()}"
    try:
        create_netns(scratch)
        netem = _netem_problem(scratch)
    except OSError as err:
        netem = f"cannot create a network namespace: {err}"
        if tun is None:
            status["tun"] = BackendStatus("tun", False, netem)
    finally:
        with contextlib.suppress(OSError):
            remove_netns(scratch)
    if netem is None and not shutil.which("tc"):
        status["netem"] = BackendStatus("netem", True, "no `tc` command: uniform jitter only (install iproute2)")
    else:
        status["netem"] = BackendStatus("netem", netem is None, netem or "kernel netem qdisc on a veth pair")
    return {name: status[name] for name in BACKENDS}


def available_backends() -> list[str]:
    """Names of the backends this host can run, most faithful first."""
    return [name for name, s in probe_backends().items() if s.available]


def choose_backend(requested: str | None = None) -> str:
    """`requested` if it can run here; None or "auto": the most faithful available backend.

    Raises:
        ValueError: unknown backend name.
        RuntimeError: the requested backend cannot run here (the message says why).
    """
    if requested in (None, "auto"):
        return available_backends()[0]
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose from auto, {', '.join(BACKENDS)}")
    status = probe_backends()[requested]
    if not status.available:
        raise RuntimeError(f"the {requested} backend cannot run here: {status.reason}")
    return requested


def make_link(profile: LinkProfile, backend: str | None = None) -> Link:
    """An unstarted Link of the chosen backend (see `choose_backend`) for `profile`."""
    name = choose_backend(backend)
    if name == "relay":
        return RelayBackend(profile)
    if name == "tun":
        from .tun import TunBackend

        return TunBackend(profile)
    from .netem import NetemBackend

    return NetemBackend(profile)


def wait_for_port(link: Link, port: int, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Block until a server listens on (server_host, port), checked from the server side.

    Raises:
        TimeoutError: nothing listens after `timeout_s`.
        RuntimeError: `proc` (the server process) exited first.
    """
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server command exited with status {proc.returncode} before listening")
        try:
            with link.server_side(), socket.create_connection((link.server_host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {link.server_host}:{port} after {timeout_s:.0f} s") from None
            time.sleep(0.1)
