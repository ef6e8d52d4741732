"""Two load cases of the verify service behind docs figures (session 56), run against a server
started by hand (`splitspec serve --target smollm2-135m --port PORT [--prefill-chunk 0]`, one thread:
OMP_NUM_THREADS=1):

    python tools/service_stress.py prefills --address 127.0.0.1:PORT [--tokens 2048 --prompts 4]
        N long prompts opened at once, each with a deadline of 2.2x one prompt's time alone: how
        many are answered (docs/serving.md "Long prompts beside decoding sessions": 0 of 4 while
        prefills alternated chunk by chunk, 2 of 4 with prefills taking turns).
    python tools/service_stress.py memory --address 127.0.0.1:PORT --pid SERVER_PID [--connections 8]
        the worker held by a 4,000-token prefill in one forward (start the server with
        --prefill-chunk 0), then CONNECTIONS x 32 Verify calls of ~3.9 MB each queued behind it; the
        server's RSS every 2 s (docs/reliability.md, the calls-in-flight row: 1.5 -> 8.2 GB before
        the server-wide cap, 3.0 GB with it).
"""
from __future__ import annotations

import argparse
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.v1 import verify_pb2 as pb
from splitspec.v1 import verify_pb2_grpc as pb_grpc

OPTIONS = [("grpc.max_receive_message_length", 256 * 2**20), ("grpc.max_send_message_length", 256 * 2**20)]


def _stub(address: str, own_connection: bool = False):
    options = OPTIONS + ([("grpc.use_local_subchannel_pool", 1)] if own_connection else [])
    return pb_grpc.VerifyServiceStub(grpc.insecure_channel(address, options=options))


def _open(stub, fingerprint: str, prompt: list[int], timeout: float) -> tuple[str, float]:
    """(status name, seconds) of one OpenSession; the session is closed again."""
    began = time.monotonic()
    try:
        reply = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt, tokenizer_fingerprint=fingerprint),
                                 timeout=timeout)
        stub.CloseSession(pb.CloseSessionRequest(session_id=reply.session_id), timeout=10)
        status = "OK"
    except grpc.RpcError as err:
        status = err.code().name
    return status, time.monotonic() - began


def prefills(args) -> None:
    stub = _stub(args.address)
    fingerprint = stub.Info(pb.InfoRequest(), timeout=30).tokenizer_fingerprint
    status, alone = _open(stub, fingerprint, [7] * args.tokens, 600)
    print(f"one {args.tokens}-token prompt alone: {status} in {alone:.1f} s")
    deadline = 2.2 * alone
    results: dict[int, tuple[str, float]] = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(
        k, _open(stub, fingerprint, [100 + k] * args.tokens, deadline))) for k in range(args.prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"{args.prompts} at once, a deadline of {deadline:.1f} s each:")
    for k in sorted(results):
        print(f"  prompt {k}: {results[k][0]} after {results[k][1]:.1f} s")


def memory(args) -> None:
    def rss_mb() -> int:
        with open(f"/proc/{args.pid}/status") as status:
            return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) // 1024

    stub = _stub(args.address)
    fingerprint = stub.Info(pb.InfoRequest(), timeout=30).tokenizer_fingerprint
    session = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=[1, 504, 3458, 314], tokenizer_fingerprint=fingerprint),
                               timeout=60).session_id
    print(f"RSS before: {rss_mb()} MB")
    threading.Thread(target=_open, args=(stub, fingerprint, [42] * 4000, 600), daemon=True).start()
    time.sleep(1)  # the long prefill holds the worker
    holder = stub.Verify.future(pb.VerifyRequest(session_id=session, step=1), timeout=600)  # holds the session's lock
    time.sleep(0.5)
    big = pb.VerifyRequest(session_id=session, step=2, forced_tokens=[40000] * 1_300_000)
    calls = [_stub(args.address, own_connection=True).Verify.future(big, timeout=600)
             for _ in range(args.connections) for _ in range(32)]
    for t in range(args.seconds // 2):
        time.sleep(2)
        pending = sum(not call.done() for call in calls)
        print(f"t={2 * (t + 1)} s: RSS {rss_mb()} MB, calls pending {pending}")
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(args.address)).Check(
        health_pb2.HealthCheckRequest(service="splitspec.v1.VerifyService"), timeout=10)
    print("health:", health_pb2.HealthCheckResponse.ServingStatus.Name(health.status))
    holder.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(required=True)
    p = sub.add_parser("prefills")
    p.add_argument("--address", required=True)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=4)
    p.set_defaults(func=prefills)
    p = sub.add_parser("memory")
    p.add_argument("--address", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--seconds", type=int, default=24)
    p.set_defaults(func=memory)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
