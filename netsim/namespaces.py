"""Network namespaces for the kernel-level backends (`tun`, `netem`): create, enter, run in, remove.

A link owns two named namespaces, `ss-cli-<pid>-<k>` (the client side) and `ss-srv-<pid>-<k>` (the
server side), visible to `ip netns list` like any other named namespace. The creating process's pid
is in the name, so namespaces left behind by a process that died without cleaning up (SIGKILL) are
found and removed by `remove_stale_namespaces()`, which every link calls before it creates its own.

Entering a namespace is per thread: `in_netns(name)` moves the calling thread only, and sockets
created inside it stay in that namespace after the thread leaves (an accepted or connected socket
belongs to the namespace it was created in). Other processes are started inside a namespace with
`netns_command(name, argv)`, which prefixes `argv` with this module's `main` (setns + exec), so no
`preexec_fn` runs in a forked child of a threaded process and iproute2 is not needed. It calls
`main` with `python -c`, not `-m`: the package imports this module, and runpy warns on every start
when `-m` runs a module its package has already imported.

Run as a program: `python -m splitspec.netsim.namespaces NAME -- COMMAND...`.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import sys
import threading
from collections.abc import Iterator

NETNS_DIR = "/var/run/netns"
PREFIX = "ss-"
_NAME = re.compile(r"^ss-(cli|srv)-(\d+)-(\d+)$")
_counter = itertools.count()
_counter_lock = threading.Lock()


def link_namespace_names() -> tuple[str, str]:
    """A fresh (client, server) pair of namespace names for one link of this process."""
    with _counter_lock:
        k = next(_counter)
    pid = os.getpid()
    return f"{PREFIX}cli-{pid}-{k}", f"{PREFIX}srv-{pid}-{k}"


def create_netns(name: str) -> None:
    """Create the named network namespace (its loopback is brought up by the caller).

    Raises:
        FileExistsError: a namespace of that name exists.
        OSError: no privilege (needs CAP_SYS_ADMIN and CAP_NET_ADMIN) or no netns support.
    """
    from pyroute2 import netns

    if name in netns.listnetns():
        raise FileExistsError(f"network namespace {name} exists")
    netns.create(name)


def remove_netns(name: str) -> bool:
    """Remove the named namespace if it exists; True if it did. Never raises for a missing one.

    Processes still inside keep the namespace alive (unnamed) until they exit: stop them first."""
    from pyroute2 import netns

    if name not in netns.listnetns():
        return False
    netns.remove(name)
    return True


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def remove_stale_namespaces() -> list[str]:
    """Remove `ss-cli-*` / `ss-srv-*` namespaces whose creating process no longer runs.

    Returns the names removed."""
    if not os.path.isdir(NETNS_DIR):
        return []
    removed = []
    for name in sorted(os.listdir(NETNS_DIR)):
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(2))):
            with contextlib.suppress(OSError):
                if remove_netns(name):
                    removed.append(name)
    return removed


@contextlib.contextmanager
def in_netns(name: str | None) -> Iterator[None]:
    """Move the calling thread into namespace `name` for the block (None: stay where it is).

    Raises:
        FileNotFoundError: no namespace of that name.
        OSError: setns failed (no privilege).
    """
    if name is None:
        yield
        return
    from pyroute2 import netns

    if not os.path.exists(os.path.join(NETNS_DIR, name)):
        raise FileNotFoundError(f"no network namespace {name}")
    saved = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        netns.setns(name, flags=0)
        try:
            yield
        finally:
            netns.setns(saved, flags=0)
    finally:
        os.close(saved)


@contextlib.contextmanager
def iproute_in(name: str | None):
    """A pyroute2 IPRoute whose netlink socket lives in namespace `name` (None: this thread's own).

    The socket is made by this thread inside `in_netns`, rather than with IPRoute(netns=...), which
    forks a child per socket: a forked copy of a process that handles SIGTERM by unwinding could run
    the parent's cleanup (and remove the namespaces) when pyroute2 terminates it."""
    from pyroute2 import IPRoute

    with in_netns(name):
        ipr = IPRoute()
    try:
        yield ipr
    finally:
        ipr.close()


def netns_command(name: str | None, argv: list[str]) -> list[str]:
    """`argv` wrapped so that it runs inside namespace `name` (None: unchanged)."""
    if name is None:
        return list(argv)
    return [sys.executable, "-c", "import sys; from splitspec.netsim.namespaces import main; sys.exit(main())",
            name, "--", *argv]


def write_sysctl(name: str, key: str, value: str) -> bool:
    """Set a per-namespace sysctl (`key` like "net/ipv6/conf/all/disable_ipv6") inside `name`.

    Returns False when the key does not exist (e.g. IPv6 compiled out); raises OSError otherwise."""
    with in_netns(name):
        try:
            with open(f"/proc/sys/{key}", "w") as f:
                f.write(value)
        except FileNotFoundError:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    """`NAME -- COMMAND...`: enter namespace NAME and exec COMMAND (exit 127 if it is not found)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m splitspec.netsim.namespaces NAME -- COMMAND...", file=sys.stderr)
        return 2
    from pyroute2 import netns

    try:
        netns.setns(argv[0], flags=0)
    except OSError as err:
        print(f"cannot enter network namespace {argv[0]}: {err}", file=sys.stderr)
        return 1
    try:
        os.execvp(argv[2], argv[2:])
    except FileNotFoundError:
        print(f"{argv[2]}: command not found", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
