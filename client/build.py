"""Assemble a client: the verifier (remote, or the in-process one the caller supplies), the
drafter and the loop, from one `ClientConfig`.

The client imports no server code: single-device mode gets its verifier from a `LocalVerifierFactory`
that the composition root (cli/main.py) passes in (server/local.py `load_local_verifier`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.models import (DEFAULT_TARGET, chat_sampling_defaults, load_tokenizer, tokenizer_fingerprint,
                                     tokenizer_source)
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.verifier import Verifier

from .drafters.factory import make_drafter
from .loop import SpeculativeDecoder
from .reconnect import OfflinePolicy
from .tree_planner import TreePlanner
from .transport import RemoteVerifier, load_client_security

# (target, device, dtype) -> (a verifier running the target in this process, its tokenizer)
LocalVerifierFactory = Callable[[str, str, str], tuple[Verifier, object]]


@dataclass(frozen=True)
class ClientConfig:
    """What a client needs, built from the generate / chat flags in one place (client/cli.py).

    server: the verify service's HOST:PORT (split mode); None = single-device, the target loaded here.
    *_timeout_s: deadlines of Info/OpenSession calls, of each Verify step, of the first connection.
    busy_wait_s: how long OpenSession is retried while the server is full for now (its session
      limit, KV budget or this client's rate); 0 = fail at once.
    auth_token_file, tls_*: PEM / token files of the channel (client/transport.py).
    """

    target: str | None  # None: DEFAULT_TARGET in single-device mode, the server's target in split mode
    drafter: DrafterSpec
    server: str | None = "127.0.0.1:50051"
    sampling: SamplingParams = SamplingParams()
    offline: OfflinePolicy = OfflinePolicy()
    device: str = "cpu"
    dtype: str = "float32"
    timeout_s: float = 60.0
    step_timeout_s: float = 10.0
    connect_timeout_s: float = 10.0
    busy_wait_s: float = 60.0
    auth_token_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: sampling fields ("temperature", "top_p") left unset: taken from the target's chat defaults
    #: (`chat_sampling`) once the target is known, the server's in split mode
    chat_defaults: tuple[str, ...] = ()


@dataclass
class ClientSetup:
    """What generate and chat need: the loop, the tokenizer, the sampling parameters."""

    decoder: SpeculativeDecoder
    tokenizer: object
    sampling: SamplingParams
    mode: str
    target: str = DEFAULT_TARGET  # the target's name as this client loads it (tokenizer, shipped drafters)
    notes: tuple[str, ...] = ()  # what the user should know before the first answer (`limit_notes`)


def build_client(cfg: ClientConfig, local_verifier: LocalVerifierFactory | None = None,
                 on_busy: Callable[[str], None] | None = None) -> ClientSetup:
    """Connect (or load the target locally), build the drafter, check tokenizer identity.
    `on_busy(message)`: told why and how long the client waits while the server is full.

    Raises:
        ValueError: single-device mode without `local_verifier`; the client's tokenizer differs
            from the server's target (TokenizerMismatch for a drafter's).
        LinkDown: the server is unreachable within cfg.connect_timeout_s.
    """
    if cfg.server is None:
        if local_verifier is None:
            raise ValueError("single-device mode needs the in-process verifier (splitspec.server)")
        target = cfg.target or DEFAULT_TARGET
        verifier, tokenizer = local_verifier(target, cfg.device, cfg.dtype)
        mode = "single-device"
    else:
        verifier = _connect(cfg, on_busy)
        mode = f"split via {cfg.server}"
        target, tokenizer = _server_tokenizer(cfg.target, verifier)
    drafter = make_drafter(cfg.drafter, target_fingerprint=verifier.info.tokenizer_fingerprint, target=target,
                           target_model=verifier.target_model, device=cfg.device, dtype=cfg.dtype,
                           seed=cfg.sampling.seed)
    planner = TreePlanner() if cfg.drafter.adaptive else None
    return ClientSetup(SpeculativeDecoder(verifier, drafter, cfg.offline, planner), tokenizer,
                       chat_sampling(cfg, target), mode, target, limit_notes(cfg.drafter, verifier.info))


def limit_notes(spec: DrafterSpec, info) -> tuple[str, ...]:
    """A line saying what the loop cuts each step (client/loop.py `_limits`) when `spec` asks for more
    than the verifier takes in one (`info`: its ServerInfo): a fixed draft tree deeper or larger, a
    prompt-lookup chain longer. Adaptive trees are chosen within the limits."""
    tree, cut = spec.tree, []
    if spec.kind != "none" and not spec.adaptive and (tree.depth > info.max_tree_depth
                                                      or tree.max_nodes > info.max_tree_nodes):
        cut.append(f"the {tree.depth}x{tree.top_b}x{tree.max_nodes} draft tree")
    if spec.lookup_depth > min(info.max_tree_depth, info.max_tree_nodes):
        cut.append(f"the {spec.lookup_depth}-token prompt-lookup chain")
    if not cut:
        return ()
    return (f"the verifier takes draft trees of at most depth {info.max_tree_depth} and {info.max_tree_nodes} "
            f"nodes a step: {' and '.join(cut)} {'are' if len(cut) > 1 else 'is'} cut to that",)


def chat_sampling(cfg: ClientConfig, target: str) -> SamplingParams:
    """cfg.sampling with the fields cfg.chat_defaults names taken from `target`'s chat defaults
    (shared/models.py `chat_sampling_defaults`: its generation config, else 0.7 / 0.9).

    Raises:
        RuntimeError: `target` is an alias whose package cannot be installed.
    """
    if not cfg.chat_defaults:
        return cfg.sampling
    temperature, top_p = chat_sampling_defaults(target)
    found = {"temperature": temperature, "top_p": top_p}
    return replace(cfg.sampling, **{name: found[name] for name in cfg.chat_defaults})


def _server_tokenizer(target: str | None, verifier) -> tuple[str, object]:
    """(target name, tokenizer) of split mode: `target` when given, else the one the server's
    `Info` names (`tokenizer_source`); either must tokenize exactly as the server's target.

    Raises:
        ValueError: the tokenizer cannot be loaded here, or differs from the server's target
            (the verifier is closed first).
    """
    info = verifier.info
    name = target or tokenizer_source(info.model_id)
    try:
        tokenizer = load_tokenizer(name)
    except (OSError, ValueError, RuntimeError) as err:
        verifier.close()
        hint = "" if target else f" (the server's target is {info.model_id})"
        raise ValueError(f"cannot load the tokenizer of {name} here{hint}: {err}; pass --target naming a local "
                         "copy of the server's model") from err
    if tokenizer_fingerprint(tokenizer) != info.tokenizer_fingerprint:
        verifier.close()
        raise ValueError(f"the tokenizer of {name} differs from the server's target {info.model_id}; "
                         "pass --target naming the server's model")
    return name, tokenizer


def _connect(cfg: ClientConfig, on_busy: Callable[[str], None] | None) -> RemoteVerifier:
    security = load_client_security(cfg.auth_token_file, cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
    return RemoteVerifier(cfg.server, cfg.timeout_s, cfg.connect_timeout_s, step_timeout_s=cfg.step_timeout_s,
                          busy_wait_s=cfg.busy_wait_s, on_busy=on_busy, **security)
