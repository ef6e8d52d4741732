"""The verify service as a child process on loopback (bench and demo measure against it)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

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
    proc = subprocess.Popen([sys.executable, "-m", "splitspec.cli", "serve", "--target", target,
                             "--port", str(port), *extra], stdout=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return proc
            except grpc.RpcError:
                time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy in time")


def stop_server(server: subprocess.Popen) -> None:
    """Terminate a server start_server started; kill it when it has not exited within 30 s."""
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
