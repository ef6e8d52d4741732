"""The verify service as a child process on loopback (bench, demo and serve-bench measure against it).

The child must never outlive the command that started it (an orphaned server keeps its port and a
model's memory): `start_server` kills it when its start-up wait is interrupted, `sigterm_exits`
turns a SIGTERM into the same unwinding as Ctrl-C, and on Linux the child is also asked to be
killed by the kernel when its parent dies in any way (prctl PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target: str, port: int, timeout_s: float = 900.0, extra: list[str] = (),
                 threads: int | None = None) -> subprocess.Popen:
    """Start `splitspec serve` as a child process and wait until its health check says SERVING.
    `threads` pins the server's torch threads (OMP_NUM_THREADS, read by torch at start-up).

    Raises:
        RuntimeError: the server exited or did not become healthy within `timeout_s`.
    """
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    # its own session: a terminal's Ctrl-C reaches only the command, whose clean-up then stops the
    # server with one SIGTERM (it got the SIGINT too, took stop_server's SIGTERM for a second signal
    # and quit without draining: QA 57)
    proc = subprocess.Popen([sys.executable, "-m", "splitspec.cli", "serve", "--target", target,
                             "--port", str(port), *extra], stdout=subprocess.DEVNULL, env=env,
                            preexec_fn=_die_with_parent(), start_new_session=True)
    try:
        _wait_healthy(proc, port, timeout_s)
    except BaseException:  # a failed start, Ctrl-C or SIGTERM (sigterm_exits) while waiting: no orphan
        proc.kill()
        proc.wait()
        raise
    return proc


def _wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float) -> None:
    """Poll the health check of the server `proc` on `port` until it says SERVING.

    Raises:
        RuntimeError: the server exited or did not become healthy within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.5)
    raise RuntimeError("server did not become healthy in time")


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent():
    """A Popen `preexec_fn` that has the kernel SIGKILL the child when the thread that started it
    exits (a SIGKILLed parent included), or None off Linux. The parent's pid is checked after the
    prctl call, so a parent that died during the fork is caught too."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
    return preexec


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While open, a SIGTERM raises SystemExit(143) in the main thread, so that the command unwinds
    as it does on Ctrl-C (its `finally` and ExitStack stop the servers and links it started). A
    second SIGTERM, during that clean-up, ends the process at once (the kernel then kills the
    servers: `_die_with_parent`). Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_on_sigterm(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def stop_server(server: subprocess.Popen) -> None:
    """Terminate a server start_server started; kill it when it has not exited within 30 s."""
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
