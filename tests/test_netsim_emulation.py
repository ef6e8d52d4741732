"""Fast netsim tests that run everywhere: cut schedules, the packet scheduler and emulator (pure,
seeded), netem's options, the capability probe, and `splitspec netsim run` over the relay."""
from __future__ import annotations

import json
import os
import random
import socket
import signal
import subprocess
import sys
import time

import pytest

from splitspec.netsim import PRESETS, CutSchedule, LinkProfile, RelayBackend, ScheduledCuts, backends
from splitspec.netsim.emulator import PacketEmulator, PacketScheduler, direction_rngs
from splitspec.netsim.netem import netem_limit, netem_pyroute2_kwargs, netem_tc_args
from splitspec.netsim.schedule import parse_duration_s
from splitspec.netsim.validate import (ProbeServer, Quantiles, echo_round_trips, expected_round_trip, format_table,
                                       validate)


# -- cut schedules --------------------------------------------------------------------------------
def test_cut_schedule_parses_units_and_orders():
    s = CutSchedule.parse("50s:10s, 120:5,3m:500ms")
    assert s.cuts == ((50.0, 10.0), (120.0, 5.0), (180.0, 0.5))
    assert s.transitions() == [(50.0, True), (60.0, False), (120.0, True), (125.0, False),
                               (180.0, True), (180.5, False)]
    assert [s.is_cut(t) for t in (49.9, 50.0, 59.99, 60.0, 124.0, 180.4)] == [False, True, True, False, True, True]
    assert CutSchedule.parse(str(s)) == s and CutSchedule.parse(None).cuts == () and CutSchedule.parse(" ").cuts == ()
    assert CutSchedule.of([(5, 1), (1, 1)]).cuts == ((1.0, 1.0), (5.0, 1.0))
    assert parse_duration_s("250ms") == 0.25 and parse_duration_s(".5") == 0.5


@pytest.mark.parametrize("spec", ["10:5,12:1", "10", "a:b", "10s:0", "-1:2", "1:2:3", "5x:1"])
def test_cut_schedule_refuses_bad_specs(spec):
    with pytest.raises(ValueError):
        CutSchedule.parse(spec)


class FakeLink:
    def __init__(self):
        self.events = []

    def cut(self):
        self.events.append("cut")

    def restore(self):
        self.events.append("restore")


def test_scheduled_cuts_apply_in_order_and_stop_restores():
    link = FakeLink()
    with ScheduledCuts(link, CutSchedule.of([(0.0, 0.02), (0.04, 0.02)])) as cuts:
        cuts._thread.join(timeout=5)
    assert link.events == ["cut", "restore", "cut", "restore"]
    assert [t for t, _ in cuts.log] == sorted(t for t, _ in cuts.log)
    link = FakeLink()
    cuts = ScheduledCuts(link, CutSchedule.of([(0.0, 60.0)])).start()
    while not link.events:
        cuts._stop.wait(0.005)
    cuts.stop()  # cancelled in the middle of the outage: the link comes back
    assert link.events == ["cut", "restore"]


# -- the packet scheduler (pure, seeded) ----------------------------------------------------------
def _scheduler(seed=0, **fields) -> PacketScheduler:
    return PacketScheduler(LinkProfile("t", seed=seed, **fields), random.Random(seed))


def test_scheduler_fixed_delay_and_serialization():
    s = _scheduler(delay_ms=10.0, rate_mbit=10.0)  # 1250 bytes = 1 ms at 10 Mbit/s
    times = [s.admit(0.0, 1250) for _ in range(3)]
    assert times == pytest.approx([0.011, 0.012, 0.013])
    assert s.backlog_bytes(0.0) == pytest.approx(3750) and s.backlog_bytes(0.0025) == pytest.approx(625)
    assert s.admit(1.0, 1250) == pytest.approx(1.011)  # an idle bottleneck starts afresh
    assert _scheduler(delay_ms=5.0).admit(2.0, 9000) == pytest.approx(2.005)  # no rate: no serialization


def test_scheduler_tail_drops_past_the_queue():
    s = _scheduler(rate_mbit=8.0, queue_kib=2)  # 2048 bytes of queue, 1000 bytes = 1 ms
    assert [s.admit(0.0, 1000) is not None for _ in range(3)] == [True, True, False]
    assert s.stats.tail_dropped == 1
    assert s.admit(0.0015, 1000) is not None  # half a packet drained: room again
    with pytest.raises(ValueError):
        s.admit(0.0, 0)


def test_scheduler_loss_rate_and_determinism():
    def run(seed):
        s = _scheduler(seed=seed, delay_ms=20.0, jitter_ms=10.0, loss_pct=20.0)
        return [s.admit(i * 1e-3, 100) for i in range(20_000)], s.stats

    first, stats = run(7)
    assert first == run(7)[0] and first != run(8)[0]
    assert stats.lost == sum(t is None for t in first)
    assert 0.19 <= stats.lost / stats.packets <= 0.21  # 20% +/- 3.5 binomial standard deviations


def test_scheduler_keeps_order_unless_reordering():
    s = _scheduler(seed=1, delay_ms=20.0, jitter_ms=15.0)
    times = [s.admit(i * 1e-4, 100) for i in range(2000)]  # 0.1 ms apart, 15 ms jitter
    assert times == sorted(times)  # in order although the draws are not
    s = _scheduler(seed=1, delay_ms=20.0, reorder_pct=30.0)
    times = [s.admit(i * 1e-4, 100) for i in range(2000)]
    assert 0.25 <= s.stats.reordered / 2000 <= 0.35 and times != sorted(times)


def test_scheduler_delay_follows_the_profile():
    s = _scheduler(seed=3, delay_ms=21.0, jitter_ms=4.0)
    delays = [(s.admit(float(i), 100) - i) * 1e3 for i in range(4000)]  # 1 s apart: no queueing
    assert 20.7 <= sum(delays) / len(delays) <= 21.3


def test_scheduler_cut_drops_everything():
    s = _scheduler(delay_ms=1.0)
    s.cut = True
    assert s.admit(0.0, 100) is None and s.stats.cut_dropped == 1
    s.cut = False
    assert s.admit(0.0, 100) == pytest.approx(0.001)


def test_direction_rngs_differ_and_repeat():
    up, down = direction_rngs(5)
    assert up.random() != down.random()
    assert direction_rngs(5)[0].random() == direction_rngs(5)[0].random()


# -- the emulator loop over packet sockets (same read/write semantics as a TUN fd) ----------------
class ManualClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_emulator_moves_packets_both_ways_after_their_delay():
    client_dev, client_app = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server_dev, server_app = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for sock in (client_dev, server_dev, client_app, server_app):
        sock.setblocking(False)
    clock = ManualClock()
    emulator = PacketEmulator(LinkProfile("t", delay_ms=10.0), client_dev.fileno(), server_dev.fileno(), clock)
    client_app.send(b"up-1")
    client_app.send(b"up-2")
    server_app.send(b"down-1")
    emulator.receive(client_dev.fileno())
    emulator.receive(server_dev.fileno())
    assert emulator.deliver_due() == pytest.approx(0.010)  # nothing due before its delay
    with pytest.raises(BlockingIOError):
        server_app.recv(100)
    clock.t = 0.010
    assert emulator.deliver_due() is None
    assert [server_app.recv(100), server_app.recv(100), client_app.recv(100)] == [b"up-1", b"up-2", b"down-1"]
    client_app.send(b"lost")
    emulator.receive(client_dev.fileno())
    emulator.set_cut(True)  # in flight when the link goes: dropped
    clock.t = 1.0
    assert emulator.deliver_due() is None
    with pytest.raises(BlockingIOError):
        server_app.recv(100)
    stats = emulator.stats()
    up = stats["up"]
    assert (up["packets"], up["delivered"], up["cut_dropped"], stats["cut"]) == (3, 3, 1, True)
    for sock in (client_dev, server_dev, client_app, server_app):
        sock.close()


# -- netem options ----------------------------------------------------------------------------------
def test_netem_tc_args_for_the_presets():
    assert netem_tc_args(PRESETS["4g"]) == ["netem", "limit", str(netem_limit(PRESETS["4g"])), "delay", "21ms", "19ms",
                                            "distribution", "normal", "loss", "0.1%", "rate", "20mbit"]
    assert netem_tc_args(PRESETS["4g"], cut=True)[-4:] == ["loss", "100%", "rate", "20mbit"]
    assert netem_tc_args(LinkProfile("u", delay_ms=5, jitter_ms=1, distribution="uniform")) == \
        ["netem", "limit", "1000", "delay", "5ms", "1ms"]
    assert netem_tc_args(PRESETS["offline"]) == ["netem", "limit", "1000", "loss", "100%"]
    # queue (256 KiB / 1514 B) + packets in flight at 20 Mbit/s during 21 + 4 x 19 ms + 16 spare
    assert netem_limit(PRESETS["4g"]) == 174 + 161 + 16
    with pytest.raises(ValueError, match="delay"):
        netem_tc_args(LinkProfile("r", reorder_pct=5))
    with pytest.raises(ValueError, match="distribution"):
        netem_pyroute2_kwargs(PRESETS["4g"])
    kwargs = netem_pyroute2_kwargs(LinkProfile("u", delay_ms=5, jitter_ms=1, distribution="uniform", rate_mbit=2))
    assert (kwargs["delay"], kwargs["jitter"], kwargs["rate"]) == (5000, 1000, "2mbit")


# -- capability probe -----------------------------------------------------------------------------
@pytest.fixture
def fresh_probe():
    backends.probe_backends.cache_clear()
    yield
    backends.probe_backends.cache_clear()


def test_probe_reports_every_backend_with_reasons(fresh_probe):
    status = backends.probe_backends()
    assert list(status) == ["netem", "tun", "relay"] and status["relay"].available
    for s in status.values():
        assert s.reason  # unavailable: why; available: what it is
    assert backends.choose_backend() == backends.available_backends()[0]
    assert backends.choose_backend("relay") == "relay"
    with pytest.raises(ValueError, match="unknown backend"):
        backends.choose_backend("ns3")
    for name, s in status.items():
        if not s.available:
            with pytest.raises(RuntimeError, match="cannot run here"):
                backends.choose_backend(name)


def test_probe_without_privileges_explains(fresh_probe, monkeypatch):
    monkeypatch.setattr(backends, "_effective_caps", lambda: 0)
    status = backends.probe_backends()
    assert not status["tun"].available and not status["netem"].available
    assert "CAP_NET_ADMIN" in status["tun"].reason and "root" in status["tun"].reason
    assert backends.available_backends() == ["relay"] and backends.choose_backend("auto") == "relay"
    with pytest.raises(RuntimeError, match="CAP_NET_ADMIN"):
        backends.choose_backend("tun")


# -- the relay through the Link interface; the probes' arithmetic ---------------------------------
def test_relay_backend_link_interface():
    link = RelayBackend(LinkProfile("t", delay_ms=4.0, seed=9))
    with pytest.raises(RuntimeError):
        link.expose(1)
    with link, ProbeServer(link) as server:
        rtts = sorted(echo_round_trips(link, server, samples=10, warmup=1))
        # every sample carries both 4 ms delays; the best one shows little else (a stalled machine
        # only ever lengthens a round trip: see tests/test_netsim.py)
        assert rtts[0] >= 8.0 and rtts[1] < 100, rtts
        assert link.describe() == {"backend": "relay", "profile": "t", "seed": 9, "link": link.profile.to_dict(),
                                   "namespaces": {"client": None, "server": None}}
        link.cut()
        assert link.is_cut and link.stats()["bytes_up"] > 0
        link.restore()
        assert link.command(["true"], "client") == ["true"]
        with pytest.raises(ValueError):
            link.command(["true"], "middle")
    assert not link.relays and not link.started


def test_quantiles_and_expected_round_trip():
    q = Quantiles.of([float(x) for x in range(1, 102)])
    assert (q.n, q.p50, q.p90, q.p99, q.max) == (101, 51.0, 91.0, 100.0, 101.0)
    exact = expected_round_trip(LinkProfile("t", delay_ms=10.0, rate_mbit=8.0), size=48)
    assert exact.p50 == exact.p99 == pytest.approx(20.0 + 2 * 100 * 8 / 8e3)
    spread = expected_round_trip(PRESETS["4g"])
    assert 40 < spread.p50 < 46 and 95 < spread.p99 < 115  # two N(21, 19) draws, each cut at 0
    with pytest.raises(ValueError):
        Quantiles.of([])
    with pytest.raises(ValueError, match="offline"):  # no round trip to expect, not 0 ms
        expected_round_trip(PRESETS["offline"])


def test_validate_offline_profile_checks_the_black_hole():
    """`offline` has no round trip: validate checks that nothing comes back over the relay (it
    used to answer after a 200 ms "retransmission" stall) and prints no expected number."""
    rows = validate(PRESETS["offline"], ["relay"], samples=5, bulk_bytes=0)
    assert [(r.backend, r.rtt, r.expected_rtt) for r in rows] == [("relay", None, None)]
    assert "| offline | relay | - | - | - | - | offline |" in format_table(rows)


# -- `splitspec netsim run` over the relay (works without root) ----------------------------------
ECHO_SERVER = """
import os, socket, sys
s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
assert os.environ["SPLITSPEC_LISTEN_PORT"] == sys.argv[2]
while True:
    c, _ = s.accept()
    with c:
        while d := c.recv(4096): c.sendall(d)
"""
ECHO_CLIENT = """
import json, os, socket, sys
host, port = sys.argv[1].rsplit(":", 1)
with socket.create_connection((host, int(port)), timeout=10) as s:
    s.sendall(b"ping"); assert s.recv(4) == b"ping"
link = json.loads(os.environ["SPLITSPEC_NETSIM"])
sys.exit(0 if link["backend"] == "relay" and link["seed"] == 4 else 5)
"""


def test_netsim_run_over_the_relay(tmp_path):
    server, client, record = tmp_path / "server.py", tmp_path / "client.py", tmp_path / "run.json"
    server.write_text(ECHO_SERVER)
    client.write_text(ECHO_CLIENT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "splitspec.netsim.cli", "run", "--profile", "5g", "--backend", "relay",
         "--seed", "4", "--port", str(port), "--cut", "30s:1s", "--record", str(record),
         "--client", f"{sys.executable} {client} {{server}}", "--", sys.executable, str(server), "{host}", "{port}"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"clients connect to 127.0.0.1:{port}" in done.stderr
    result = json.loads(record.read_text())
    assert (result["link"]["backend"], result["link"]["profile"], result["link"]["seed"]) == ("relay", "5g", 4)
    assert result["exit"] == 0 and result["cuts"] == "30s:1s" and result["applied_cuts"] == []
    assert result["stats"]["bytes_up"] >= 4
    # the commands as run, and as given
    assert result["client"] == [sys.executable, str(client), f"127.0.0.1:{port}"]
    assert result["client_template"][-1] == "{server}" and result["server_template"][-2:] == ["{host}", "{port}"]
    assert result["server"][-2] == "127.0.0.1" and int(result["server"][-1]) != port  # the relay's private port


def test_netsim_run_exit_status_of_a_client_killed_by_a_signal(tmp_path):
    server = tmp_path / "server.py"
    server.write_text(ECHO_SERVER)
    done = subprocess.run(
        [sys.executable, "-m", "splitspec.netsim.cli", "run", "--profile", "lan", "--backend", "relay",
         "--port", "0", "--client", "sh -c 'kill -9 $$'", "--", sys.executable, str(server), "{host}", "{port}"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGKILL, done.stderr  # as a shell reports it, not 256 - 9


@pytest.mark.parametrize("argv, message", [
    (["run", "--profile", "lan", "--port", "99999", "--", "true"], "--port: 99999 must lie in 0..65535"),
    (["run", "--profile", "lan", "--wait", "-1", "--", "true"], "--wait: -1 must be a finite number of seconds >= 0"),
    (["run", "--profile", "lan", "--wait", "inf", "--", "true"], "--wait: inf must be a finite"),
    (["validate", "--samples", "0"], "--samples: 0 must be >= 1"),
    (["validate", "--grpc", "-1"], "--grpc: -1 must be >= 0"),
    (["validate", "--bulk-mb", "0.1"], "--bulk-mb: 0.1 must be 0 (skip) or at least 0.262144 MB"),
    (["validate", "--bulk-mb", "nan"], "--bulk-mb: nan must be 0"),
])
def test_netsim_cli_checks_numbers_before_building_links(argv, message, capsys, monkeypatch):
    from splitspec.cli.main import main
    from splitspec.netsim import cli

    monkeypatch.setattr(cli, "make_link", lambda *a, **k: pytest.fail("a link was built"))
    monkeypatch.setattr(cli, "validate", lambda *a, **k: pytest.fail("the probes ran"))
    with pytest.raises(SystemExit) as exit_:
        main(["netsim", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["run", "--profile", "lan", "--record", "{bad}", "--", "true"],
                                  ["validate", "--profile", "lan", "--json", "{bad}"]])
def test_netsim_checks_its_output_file_before_building_links(argv, capsys, monkeypatch, tmp_path):
    """An unwritable --record / --json is refused before any link is built (it failed after the
    whole run, losing its outcome and replacing the client's exit status: QA 56)."""
    from splitspec.cli.main import main
    from splitspec.netsim import cli

    monkeypatch.setattr(cli, "make_link", lambda *a, **k: pytest.fail("a link was built"))
    monkeypatch.setattr(cli, "validate", lambda *a, **k: pytest.fail("the probes ran"))
    bad = str(tmp_path / "no-such-folder" / "out.json")
    assert main(["netsim", *[bad if a == "{bad}" else a for a in argv]]) == 2
    assert f"{argv[argv.index('{bad}') - 1]} {bad}: cannot write it" in capsys.readouterr().err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_netsim_validate_stops_promptly_on_a_signal(signum):
    """Ctrl-C or SIGTERM during the echo probes (about 25 s of them here) ends `validate` within a
    few seconds: the probes stop after their round trip in progress, then the links are removed."""
    # a child started in the background (a script's `&`, as CI may run) inherits SIGINT ignored: set it default
    proc = subprocess.Popen([sys.executable, "-m", "splitspec.netsim.cli", "validate", "--profile", "4g",
                             "--backends", "relay", "--samples", "500", "--bulk-mb", "0", "--grpc", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert "echo round trips" in proc.stderr.readline()
        time.sleep(1.0)
        sent = time.monotonic()
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 128 + signum
        assert time.monotonic() - sent < 5.0
    finally:
        proc.kill()
        proc.wait()


def test_netsim_cli_refuses_clearly(capsys):
    from splitspec.cli.main import main

    assert main(["netsim", "run", "--profile", "4g", "--backend", "relay"]) == 2
    assert "give the server command" in capsys.readouterr().err
    assert main(["netsim", "run", "--profile", "4g", "--cut", "5:1,3:1", "--", "true"]) == 2
    assert "overlap" in capsys.readouterr().err
    assert main(["netsim", "probe", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["relay"]["available"] is True


def test_namespace_names_carry_the_pid():
    from splitspec.netsim.namespaces import _NAME, link_namespace_names, netns_command

    client, server = link_namespace_names()
    assert _NAME.match(client).group(2) == str(os.getpid()) and client.replace("cli", "srv") == server
    assert netns_command(None, ["x"]) == ["x"]
    assert netns_command("ns", ["x", "-y"])[-4:] == ["ns", "--", "x", "-y"]


def test_namespace_helper_starts_without_a_runpy_warning():
    """The helper that enters a namespace runs without runpy's "found in sys.modules" warning on
    the command's stderr (the namespace here does not exist, so it stops at setns)."""
    from splitspec.netsim.namespaces import netns_command

    done = subprocess.run(netns_command("ss-none-0-0", ["true"]), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "cannot enter network namespace ss-none-0-0" in done.stderr
    assert "Warning" not in done.stderr, done.stderr
