"""A relay link that switches profiles while connections are open (issue 13's bench of links
changing within an answer): the spec, the schedule, and the delay a message sees before and after
a switch, on a thread relay and through the relay child process."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from splitspec.bench.bench import link_profiles
from splitspec.netsim.profiles import LinkProfile
from splitspec.netsim.relay import RelayProcess, RelayThread
from splitspec.netsim.schedule import ProfileSwitching, ScheduledSwitches

SLOW = LinkProfile(name="slow", delay_ms=60.0, jitter_ms=0.0, rate_mbit=None)
FAST = LinkProfile(name="fast", delay_ms=2.0, jitter_ms=0.0, rate_mbit=None)


def test_spec():
    assert ProfileSwitching.parse("4g") is None
    switching = ProfileSwitching.parse("4g~lan/10s")
    assert switching.names == ("4g", "lan") and switching.period_s == 10.0 and switching.name == "4g~lan/10s"
    for bad in ("4g~lan", "4g~lan/0s", "4g~lan/x"):
        with pytest.raises(ValueError):
            ProfileSwitching.parse(bad)
    with pytest.raises(ValueError):
        link_profiles("4g~/10s")  # no such profile ""
    start, switching, phases = link_profiles("4g~lan/10s", seed=3)
    assert start.name == "4g~lan/10s" and start.delay_ms == phases[0].delay_ms and phases[1].name == "lan"
    assert all(p.seed == 3 for p in phases)


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_schedule_alternates_and_restarts():
    applied = []

    class Link:
        def set_profile(self, profile):
            applied.append(profile.name)

    with ScheduledSwitches(Link(), ProfileSwitching(("slow", "fast"), 0.05), [SLOW, FAST]) as switches:
        _wait_for(lambda: len(applied) >= 4)
    assert applied[:4] == ["fast", "slow", "fast", "slow"]
    assert [name for _, name in switches.log] == applied

    applied.clear()
    switches = ScheduledSwitches(Link(), ProfileSwitching(("slow", "fast"), 1.0), [SLOW, FAST]).start()
    try:
        _wait_for(lambda: applied == ["fast"])
        switches.restart()  # back to the first profile at once, the next switch a full period later
        assert applied == ["fast", "slow"]
        time.sleep(0.2)
        assert applied == ["fast", "slow"]
        _wait_for(lambda: len(applied) == 3)
        assert applied[-1] == "fast"
    finally:
        switches.stop()


def _echo_server() -> tuple[socket.socket, int]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def _rtt_ms(sock: socket.socket) -> float:
    start = time.perf_counter()
    sock.sendall(b"x")
    assert sock.recv(16) == b"x"
    return (time.perf_counter() - start) * 1e3


@pytest.mark.parametrize("kind", [RelayThread, RelayProcess])
def test_an_open_connection_feels_the_switch(kind):
    server, port = _echo_server()
    relay = kind(SLOW, ("127.0.0.1", port))
    try:
        host, relay_port = relay.address.rsplit(":", 1)
        with socket.create_connection((host, int(relay_port))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            slow = min(_rtt_ms(sock) for _ in range(3))
            relay.set_profile(FAST)
            time.sleep(0.05)
            fast = min(_rtt_ms(sock) for _ in range(3))
        assert slow >= 115.0 and fast < 90.0, (slow, fast)  # 2 x 60 ms before, 2 x 2 ms (+ scheduling) after
    finally:
        relay.stop()
        server.close()
