"""`splitspec up`: the client daemon, a long-running process holding the drafter and the link to
the verify service (or the target itself with --local), serving the OpenAI-compatible API on
127.0.0.1 by default (docs/daemon.md). FastAPI and uvicorn load when the command runs (the
`daemon` extra)."""
from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import threading
from functools import partial

from splitspec.shared.compute import loaded_on_compute_thread
from splitspec.shared.config import port_number

DEFAULT_PORT = 8765
EXIT_GRACE_S = 3.0  # after the server stops, the running answer's step gets this long to end


def add_daemon_parser(sub, local_verifier=None) -> None:
    """`up`. `local_verifier`: the LocalVerifierFactory --local uses (client/build.py)."""
    from ..cli import add_client_args

    p = sub.add_parser("up", help="the client daemon: an OpenAI-compatible API on this device")
    add_client_args(p, chat=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this device only)")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="0 = any free port")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* and /splitspec/* (the chat history); /health "
                        "stays open (default: $SPLITSPEC_API_KEY, else none)")
    p.add_argument("--max-queue", type=int, default=8,
                   help="requests that may wait behind the running answer; more are refused with 429")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--history", default=None, help="the chat page's SQLite history "
                   "(default ~/.local/share/splitspec/chat.sqlite3, shared with `splitspec chat`)")
    # --seed (from add_client_args): the seed of requests without one; unset = a random one each
    p.set_defaults(seed=None)
    p.set_defaults(func=partial(cmd_up, local_verifier=local_verifier))


def cmd_up(args, local_verifier=None) -> None:
    """Build the client, print the daemon's URL, serve until interrupted.

    Raises:
        ValueError: bad client flags, --max-queue < 0, a --system that is not UTF-8 text, or a
            non-loopback --host without an API key.
        LinkDown: the verify service is unreachable at start-up.
        OSError: the port is taken.
    """
    from ..build import build_client
    from ..cli import chat_text, client_config

    api_key = args.api_key or os.environ.get("SPLITSPEC_API_KEY") or None
    if args.max_queue < 0:
        raise ValueError("--max-queue must be >= 0")
    chat_text(args.system, "--system")  # else every request would fail, blaming its messages
    if not loopback_host(args.host) and not api_key:
        raise ValueError(f"--host {args.host} is reachable from other machines: set --api-key")
    from ..history import ChatHistory, default_path

    config = client_config(argparse.Namespace(**{**vars(args), "seed": args.seed or 0}))
    # built on the thread that will write every answer: one OpenMP pool (shared/compute.py)
    worker, setup = loaded_on_compute_thread("splitspec-answer", build_client, config, local_verifier)
    history = ChatHistory(args.history or default_path())
    app = daemon_app(setup, setup.target, api_key=api_key, max_queue=args.max_queue,
                     max_new_tokens=args.max_new_tokens, private_ngram=args.private_ngram,
                     max_request_bytes=args.max_request_bytes, system=args.system, history=history,
                     worker=worker, seed=args.seed, host=args.host)
    server = DaemonServer(app, args.host, args.port)
    sampling = setup.sampling
    extra = (f" top-k {sampling.top_k}" if sampling.top_k else "") + (
        f" contextual penalty {sampling.penalty:g} over {sampling.penalty_window}" if sampling.penalty != 1 else "") + (
        f" seed {args.seed}" if args.seed is not None else "")
    print(f"splitspec up: {setup.mode}, drafter {setup.decoder.drafter.name}, default temperature "
          f"{sampling.temperature:g} top-p {sampling.top_p:g}{extra}{', API key required' if api_key else ''}\n"
          f"  chat page        {server.url}/\n"
          f"  OpenAI base URL  {server.url}/v1\n  health           {server.url}/health\n"
          f"  chat history     {history.path}" + "".join(f"\n  note: {note}" for note in setup.notes), flush=True)
    interrupted = False
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it stopped on
        interrupted = True
        raise
    finally:
        setup.decoder.verifier.close()  # split mode: the running step's call ends now
        _exit_unless_idle(app.state.engine, 130 if interrupted else 0)


def _exit_unless_idle(engine, status: int, grace_s: float = EXIT_GRACE_S) -> None:
    """Ends the process now (status `status`) when the running answer has not ended within
    `grace_s` seconds of the server's stop: one model step cannot be interrupted (a prompt's
    prefill stops at the next chunk of 512 tokens, server/local.py `PREFILL_CHUNK`: ~1-3 s on two
    cores; in one forward an 8K-token prompt was ~35 s), and the interpreter would otherwise wait
    for its thread at exit. Nothing is lost: the chat history
    commits each token as it is written."""
    if engine.wait_idle(grace_s):
        return
    print(f"splitspec up: stopped; the running answer's model step did not end within {grace_s:g} s "
          "and is abandoned", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def daemon_app(setup, target: str, *, api_key: str | None = None, max_queue: int = 8, max_new_tokens: int = 256,
               private_ngram: int = 2, max_request_bytes: int = 1 << 20, system: str | None = None, history=None,
               worker=None, seed: int | None = None, host: str = "127.0.0.1"):
    """The FastAPI app over a built client (`setup`: client/build.py ClientSetup). Its sampling
    gives the requests' default temperature and top-p and every request's top-k and contextual
    penalty (as in `splitspec chat`); `seed` is the seed of requests without one (None: a random
    one each); `target` (the name given) and the served model id are both accepted as `model`;
    `system` is the system prompt of requests without one; `history` (client/history.py
    ChatHistory) backs the chat page's conversations; `worker`: the `compute_thread` that built
    `setup` (see Engine); `host`: the address the daemon listens on (a loopback one: requests
    must name a loopback host)."""
    from .app import create_app
    from .engine import Engine, EngineConfig

    model_id = setup.decoder.verifier.info.model_id
    names = tuple(dict.fromkeys([model_id, target]))
    sampling = setup.sampling
    engine = Engine(setup, EngineConfig(names, max_new_tokens, sampling.temperature, sampling.top_p, max_queue,
                                        private_ngram, system, top_k=sampling.top_k, penalty=sampling.penalty,
                                        penalty_window=sampling.penalty_window, seed=seed), history, worker=worker)
    app = create_app(engine, api_key=api_key, max_request_bytes=max_request_bytes, mode=setup.mode,
                     drafter=setup.decoder.drafter.name, host=host)
    app.state.engine = engine
    return app


class DaemonServer:
    """uvicorn serving `app` on a socket bound at construction (port 0 = a free one), in the
    foreground (`run`) or on a thread (`start` / `stop`)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family)
        self.host, self.port = host, self.socket.getsockname()[1]
        self.app = app
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = _uvicorn_server(config, on_exit=self._shut_down_engine)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve until SIGINT / SIGTERM."""
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self._close_engine()

    def start(self, timeout_s: float = 30.0) -> "DaemonServer":
        """Serve on a background thread; returns once it accepts connections.

        Raises:
            RuntimeError: it did not start within `timeout_s`.
        """
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True,
                                       name="splitspec-daemon")
        self.thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout_s / 0.05)):
            if self.server.started:
                return self
            deadline.wait(0.05)
        raise RuntimeError(f"the daemon did not start within {timeout_s:g} s")

    def stop(self) -> None:
        self._shut_down_engine()
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
        self._close_engine()
        self.socket.close()

    def _shut_down_engine(self) -> None:
        engine = getattr(self.app.state, "engine", None)
        if engine is not None:
            engine.shut_down()

    def _close_engine(self) -> None:
        engine = getattr(self.app.state, "engine", None)
        if engine is not None:
            engine.close()


def _uvicorn_server(config, on_exit):
    """A uvicorn server that first calls `on_exit` (Engine.shut_down: the requests in flight end with
    a clear 503) when a signal stops it; uvicorn alone would cancel them after its graceful-shutdown
    timeout, and a client would get a bare 500 or a cut stream. uvicorn loads here (the extra)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # a signal handler may run while this thread holds the engine's lock: not on this thread
            threading.Thread(target=on_exit, name="splitspec-shutdown", daemon=True).start()
            super().handle_exit(sig, frame)

    return Server(config)


def loopback_host(host: str) -> bool:
    """Whether `host` (a name or an address) is this device only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

