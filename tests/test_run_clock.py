"""train/clock.py: a run paused with SIGTSTP and resumed with SIGCONT does not count the pause
against `--max-minutes`; a run paused with SIGSTOP (uncatchable) does."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGTSTP"), reason="needs POSIX job control")

CHILD = """
import sys, time
from splitspec.train.clock import RunClock
clock = RunClock().install()
start = time.monotonic()
print("ready", flush=True)
sys.stdin.readline()
print(f"{clock.elapsed():.3f} {time.monotonic() - start:.3f} {clock.paused_s:.3f}", flush=True)
"""


def _state(pid: int) -> str:
    """The process state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _pause_child(stop_signal: int, pause_s: float = 1.5, new_session: bool = False) -> tuple[float, float, float]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             start_new_session=new_session)
    try:
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, stop_signal)
        time.sleep(pause_s)
        if os.path.exists(f"/proc/{child.pid}/stat"):
            assert _state(child.pid) == "T", "the paused run is still running"
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.2)  # let the SIGCONT handler run before asking
        out, _ = child.communicate("go\n", timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    counted, wall, paused = map(float, out.split())
    return counted, wall, paused


@pytest.mark.parametrize("new_session", [False, True], ids=["foreground", "orphaned-group"])
def test_sigtstp_pause_is_not_counted(new_session):
    """In its own session (as `nohup splitspec train ... &` from a script that has exited) the run's
    process group is orphaned and the kernel discards a default-action SIGTSTP: it must still stop."""
    counted, wall, paused = _pause_child(signal.SIGTSTP, new_session=new_session)
    assert wall >= 1.5
    assert paused >= 1.3
    assert counted == pytest.approx(wall - paused, abs=0.05)
    assert counted < wall - 1.3


def test_sigstop_pause_is_counted():
    counted, wall, paused = _pause_child(signal.SIGSTOP)
    assert paused == 0.0
    assert counted >= 1.5


STOPPING_CHILD = """
import signal, sys, time
from splitspec.train.clock import RunClock
clock = RunClock().install()
print("ready", flush=True)
deadline = time.monotonic() + 30
while not clock.stop_requested and time.monotonic() < deadline:
    time.sleep(0.01)
print("stop requested" if clock.stop_requested else "no stop", flush=True)
sys.stdin.readline()  # the parent sends the second signal now
time.sleep(30)
print("survived", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_first_stop_signal_asks_a_clean_stop_and_a_second_one_is_not_caught(sig):
    """The first SIGINT / SIGTERM only sets `stop_requested` (the trainer saves and exits); a second
    one has the default effect, so a run that hangs can still be killed."""
    # a child started in the background ignores SIGINT unless something installs a handler: set it default
    child = subprocess.Popen([sys.executable, "-c", STOPPING_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, sig)
        assert child.stdout.readline().strip() == "stop requested"
        assert child.poll() is None  # still running: the first signal only asked
        child.stdin.write("go\n")
        child.stdin.flush()
        time.sleep(0.2)
        os.kill(child.pid, sig)
        out, _ = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
    assert "survived" not in out
    assert child.returncode != 0
