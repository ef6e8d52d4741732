"""The client's commands: `splitspec generate` and `splitspec chat`.

`add_client_parsers` adds them to the top-level parser (cli/main.py); their flags become one
`ClientConfig` here (`client_config`), in one place. The loop, the drafters and the gRPC stack
load when a command runs, so that `splitspec --help` stays quick.
"""
from __future__ import annotations

import argparse
import json
import secrets
import sys
from dataclasses import asdict, replace
from functools import partial

import grpc

from splitspec.shared.config import TreeConfig, at_least
from splitspec.shared.drafters.spec import DEFAULT_DRAFT_VOCAB, DEFAULT_LOOKUP, QUANTIZATIONS, DrafterSpec
from splitspec.shared.models import DEFAULT_TARGET
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.verifier import LinkDown

from .answer import AnswerTokens
from .history import ChatHistory, default_path
from .privacy import PrivacyGuard, encode_private_chat, parse_private_tags, placeholder_token, tag_private_answer
from .reconnect import OfflinePolicy
from .stream import TextStream


def add_client_parsers(sub, local_verifier=None) -> None:
    """generate and chat. `local_verifier`: the LocalVerifierFactory (client/build.py) that
    --local uses; the composition root passes server/local.py's."""
    p = sub.add_parser("generate", help="generate one answer")
    add_client_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(func=partial(cmd_generate, local_verifier=local_verifier))
    p = sub.add_parser("chat", help="multi-turn terminal chat")
    add_client_args(p, chat=True)
    p.add_argument("--history", default=None, help="chat history SQLite file "
                   "(default ~/.local/share/splitspec/chat.sqlite3)")
    p.add_argument("--resume", action="store_true", help="continue the last conversation in --history")
    p.set_defaults(func=partial(cmd_chat, local_verifier=local_verifier))


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def server_address(value: str) -> str:
    """argparse type of --server: HOST:PORT with a port in 1..65535 (gRPC would take 83587 as 18051)."""
    host, colon, port = value.strip().rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r}: expected HOST:PORT with a port in 1..65535")
    return value.strip()


def add_client_args(p: argparse.ArgumentParser, chat: bool = False) -> None:
    """The flags generate, chat and up share. `chat`: sampling by default (temperature and top-p
    from the target's generation config, else 0.7 / 0.9: small models loop under greedy
    decoding); else greedy by default."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", default="127.0.0.1:50051", type=server_address,
                       help="verify service HOST:PORT (split mode)")
    where.add_argument("--local", action="store_true", help="single-device mode: target in this process")
    p.add_argument("--target", default=None,
                   help=f"target model: loaded here with --local (default {DEFAULT_TARGET}); with --server, "
                        "where its tokenizer comes from (default: the model the server reports)")
    p.add_argument("--drafter", default="auto",
                   help="auto | none | ngram | draft-model:MODEL[@layers=N] | moa[:tli=N|:PATH] | eagle2[:PATH] | "
                        "falcon[:PATH] | tokenswift[:PATH] | swift[:ratio=R]; auto = the MoA checkpoint shipped for the target, else ngram; swift "
                        "drafts with the target's own layers, so with --server the target's weights must also be "
                        "here (--target), and the server sends every layer's K/V; options ;lsa= ;quant= "
                        ";vocab= ;tree=DxBxN ;lookup=K override the flags below (shared/drafters/spec.py)")
    # these three default to None so that a drafter which ignores them can refuse them (DrafterSpec.parse)
    p.add_argument("--lsa-placement", default=None, choices=["client", "server"],
                   help="MoA: run Layer Self-Attention here (server sends all layers' K/V) or on the server "
                        "(default: client)")
    p.add_argument("--feature-quant", default=None, choices=sorted(QUANTIZATIONS),
                   help="quantization of the features the server sends (default int8: half fp16's bytes; the shipped "
                        "moa's drafts came out identical on 28 Spec-Bench prompts, docs/benchmarks.md session 44)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="moa/eagle2/falcon/tokenswift: draft among the N most frequent tokens (FR-Spec); 0 = the full vocabulary; "
                        f"default: {DEFAULT_DRAFT_VOCAB} when the target has shipped token counts")
    p.add_argument("--prompt-lookup", type=int, default=-1, metavar="K",
                   help="merge a prompt-lookup chain of up to K tokens into each draft tree (0 = off; default: "
                        f"{DEFAULT_LOOKUP} for every drafter but none and ngram; when sampling, only below the "
                        "drafter's leaves)")
    p.add_argument("--no-spec", action="store_true", help="baseline: one target call per token")
    p.add_argument("--max-new-tokens", type=at_least(1, int), default=256)
    if chat:
        p.add_argument("--temperature", type=float, default=None,
                       help="0 = greedy; default: the target's generation config, else 0.7")
        p.add_argument("--top-p", type=float, default=None, help="default: the target's generation config, else 0.9")
    else:
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
        p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    if chat:
        p.add_argument("--seed", type=int, default=None,
                       help="the seed of every answer (reproducible); default: a random one per answer")
    else:
        p.add_argument("--seed", type=int, default=0)
    p.add_argument("--contextual-penalty", type=float, default=1.0,
                   help="TokenSwift's contextual penalty (e.g. 1.2; 1 = off): the target's logits of the tokens among "
                        "the last --penalty-window tokens are divided (positive) or multiplied (negative) by it. This "
                        "changes the target's distribution on purpose: the output is exact for the penalised "
                        "target, not the plain one")
    p.add_argument("--penalty-window", type=int, default=1024, help="tokens the contextual penalty looks back over")
    p.add_argument("--tree-depth", type=int, default=TreeConfig.depth)
    p.add_argument("--tree-top-b", type=int, default=TreeConfig.top_b)
    p.add_argument("--tree-nodes", type=int, default=TreeConfig.max_nodes)
    p.add_argument("--adaptive-tree", action="store_true",
                   help="network-aware trees: pick each step's depth, top-B and nodes from the measured link, "
                        "verify and drafting times and acceptance (moa, eagle2, falcon, tokenswift, draft-model; "
                        "client/tree_planner.py)")
    p.add_argument("--system", default=None, help="system prompt (chat template)")
    p.add_argument("--timeout", type=at_least(0, strict=True), default=60.0,
                   help="deadline of Info and OpenSession calls, s")
    p.add_argument("--step-timeout", type=at_least(0, strict=True), default=10.0,
                   help="deadline of each Verify step, s; missing it continues offline")
    p.add_argument("--connect-timeout", type=at_least(0, strict=True), default=10.0, help="wait for the server, s")
    p.add_argument("--busy-wait", type=at_least(0), default=60.0,
                   help="while the server is full (max sessions, KV budget, rate limit), retry opening a "
                        "session with backoff for this long, s (0 = fail at once)")
    p.add_argument("--on-reconnect", default="heal", choices=["heal", "keep"],
                   help="offline text the target rejects: replace it with the target's continuation, or keep it")
    p.add_argument("--no-offline", action="store_true",
                   help="fail when the server is unreachable instead of continuing with the drafter alone")
    p.add_argument("--private-ngram", type=at_least(1, int), default=2,
                   help="withhold drafts completing this many consecutive tokens of <private> text (1 = any)")
    p.add_argument("--auth-token-file", default=None, help="bearer token file (first token; else $SPLITSPEC_AUTH_TOKEN)")
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle to verify the server (enables TLS)")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate (mTLS; enables TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    add_device_args(p)


def client_config(args):
    """The ClientConfig (client/build.py) of the generate / chat flags.

    A --temperature / --top-p left unset (chat, up) is named in `chat_defaults`: build_client takes
    it from the target's chat defaults once the target is known (in split mode the server's).

    Raises:
        ValueError: a bad --drafter or tree size, sampling parameters out of range, or --no-spec with
            --adaptive-tree.
    """
    from .build import ClientConfig

    unset = tuple(name for name in ("temperature", "top_p") if getattr(args, name) is None)
    # the unset ones hold valid stand-ins until build_client fills them in
    temperature = 0.0 if args.temperature is None else args.temperature
    top_p = 1.0 if args.top_p is None else args.top_p
    tree = TreeConfig(depth=args.tree_depth, top_b=args.tree_top_b, max_nodes=args.tree_nodes)
    if args.no_spec and args.adaptive_tree:  # the drafter check below would name a "none" never given
        raise ValueError("--adaptive-tree picks draft trees, and --no-spec sends none: use one of them")
    flags = {"lsa": "--lsa-placement", "quant": "--feature-quant", "vocab": "--draft-vocab"}
    given = {key: getattr(args, flag[2:].replace("-", "_")) for key, flag in flags.items()}
    given = {key: value for key, value in given.items() if value is not None}
    drafter = DrafterSpec.parse("none" if args.no_spec else args.drafter, tree=tree, lookup=args.prompt_lookup,
                                adaptive=args.adaptive_tree, flags={key: flags[key] for key in given}, **given)
    return ClientConfig(
        target=args.target, drafter=drafter, server=None if args.local else args.server,
        sampling=SamplingParams(temperature, top_p, args.top_k, 0 if args.seed is None else args.seed,
                                args.contextual_penalty, args.penalty_window),
        offline=OfflinePolicy(enabled=not args.no_offline, on_reconnect=args.on_reconnect),
        device=args.device, dtype=args.dtype, timeout_s=args.timeout, step_timeout_s=args.step_timeout,
        connect_timeout_s=args.connect_timeout, busy_wait_s=args.busy_wait, auth_token_file=args.auth_token_file, tls_ca=args.tls_ca,
        tls_cert=args.tls_cert, tls_key=args.tls_key, chat_defaults=unset)


def _encode(setup, args, messages: list[dict[str, str]]):
    """Prompt ids and, when the messages hold <private> spans, the PrivacyGuard for them.

    Raises ValueError: a message that is not valid UTF-8 text (`utf8_text`), or private tags that
    do not pair up."""
    for message in messages:
        utf8_text(message["content"], f"the {message['role']} message")
    ids, mask = encode_private_chat(setup.tokenizer, messages)
    guard = PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(setup.tokenizer), args.private_ngram,
                         decode=setup.tokenizer.decode)
    return ids, (guard if guard.active else None)


def utf8_text(text: str | None, what: str) -> str | None:
    """`text` as given, checked to be valid UTF-8: bytes that are not (in argv or on stdin) reach
    Python as lone surrogates, which the tokenizer refused with a TypeError traceback.

    Raises ValueError naming `what` and the first bad byte."""
    try:
        (text or "").encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        bad = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise ValueError(f"{what} is not valid UTF-8 text ({bad} at character {err.start + 1})") from None
    return text


def chat_text(text: str | None, what: str) -> str | None:
    """`text` (a --prompt or --system) checked before any model loads: valid UTF-8 (`utf8_text`)
    and its `<private>` tags paired.

    Raises ValueError naming `what`."""
    utf8_text(text, what)
    try:
        parse_private_tags(text or "")
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None
    return text


def _messages(args, history: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": args.system}] if args.system else []) + history


def _setup(args, local_verifier):
    from .build import build_client

    setup = build_client(client_config(args), local_verifier, on_busy=_tell)
    for note in setup.notes:
        _tell(note)
    return setup


def _tell(message: str) -> None:
    """Tell the user on stderr why the client waits, or what it cuts (stdout may hold --json output)."""
    print(f"splitspec: {message}", file=sys.stderr, flush=True)


def cmd_generate(args, local_verifier=None) -> None:
    chat_text(args.prompt, "--prompt")  # before the models load
    chat_text(args.system, "--system")
    setup = _setup(args, local_verifier)
    prompt_ids, privacy = _encode(setup, args, _messages(args, [{"role": "user", "content": args.prompt}]))
    stream = AnswerTokens() if args.json else TextStream(setup.tokenizer)
    try:
        gen = setup.decoder.generate(prompt_ids, args.max_new_tokens, setup.sampling, on_event=stream,
                                     privacy=privacy)
    except Exception as err:  # the link stayed down, a refusal: --json still says what was written
        if args.json:
            print(json.dumps({"mode": setup.mode, "drafter": setup.decoder.drafter.name,
                              "prompt_tokens": len(prompt_ids), "token_ids": stream.ids, "sources": stream.sources,
                              "text": setup.tokenizer.decode(stream.ids, skip_special_tokens=True),
                              "complete": False, "error": f"{type(err).__name__}: {err}"}))
        raise
    finally:
        if not args.json:
            stream.finish()
    text = setup.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"mode": setup.mode, "drafter": setup.decoder.drafter.name, "prompt_tokens": len(prompt_ids),
                          "token_ids": gen.tokens, "sources": gen.sources, "text": text, "complete": True,
                          "stopped_by_eos": gen.stopped_by_eos, "context_full": gen.context_full,
                          "stats": gen.stats.as_dict(),
                          "calls": [asdict(c) for c in gen.stats.calls]}))
    else:
        if gen.context_full:
            print(f"\n(the target's context of {setup.decoder.verifier.info.max_context} tokens is full)", end="")
        print(f"\n{gen.stats.summary()}")
    setup.decoder.verifier.close()


def _chat_turn(setup, args, history_db, conversation: int, line: str, prompt_ids, privacy, stream):
    """One chat answer, streamed and stored as it grows; the stored answer stays incomplete when the
    turn fails (the error propagates). Returns (the Generation, the answer's text for the history:
    `<private>` tags around what the client wrote from private spans, so the next turn's prompt,
    which holds the answer, keeps those words on this device)."""
    history_db.add_message(conversation, "user", line)
    answer = history_db.add_message(conversation, "assistant", "", complete=False)
    writer = history_db.answer_writer(answer)
    print("bot> ", end="", flush=True)
    sampling = setup.sampling
    if args.seed is None and not sampling.greedy:  # each answer its own seed: a fixed default gave every
        sampling = replace(sampling, seed=secrets.randbits(63))  # run the same answer to the same question
    try:
        gen = setup.decoder.generate(prompt_ids, args.max_new_tokens, sampling, privacy=privacy,
                                     on_event=lambda e: (writer(e), stream(e)))
    finally:
        stream.finish()
    text = tag_private_answer(setup.tokenizer, gen.tokens, gen.sources)
    history_db.finish(answer, text)
    return gen, text


def cmd_chat(args, local_verifier=None) -> None:
    chat_text(args.system, "--system")  # these two before the models load
    history_db = ChatHistory(args.history or default_path())
    setup = _setup(args, local_verifier)
    conversation = history_db.last_conversation() if args.resume else None
    history: list[dict[str, str]] = []
    if conversation is not None:
        for m in history_db.messages(conversation):
            content = m["content"] if m["complete"] else history_db.recover(m["id"], setup.tokenizer)
            if m["role"] == "assistant" and not m["complete"] and not content:
                continue  # a turn that failed before its first token: no answer to replay
            history.append({"role": m["role"], "content": content})
    sampling = setup.sampling
    seeded = "" if sampling.greedy or args.seed is None else f", seed {args.seed}"
    print(f"splitspec chat ({setup.mode}, drafter {setup.decoder.drafter.name}, {sampling.describe()}{seeded}, "
          f"history {history_db.path}, "
          f"{len(history)} earlier messages). Mark private text <private>like this</private>. /reset /stats /quit")
    last_stats = None
    while True:
        try:
            line = input("\nyou> ").strip()
        except EOFError:
            break
        if not line:
            continue
        if line == "/quit":
            break
        if line == "/reset":
            history.clear()
            conversation = None  # made at the next message: an empty one would be what --resume finds
            last_stats = None
            print("(new conversation)")
            continue
        if line == "/stats":
            print(last_stats.summary() if last_stats else "(no answer yet)")
            continue
        if line.startswith("//"):  # a message that begins with "/"
            line = line[1:]
        elif line.startswith("/"):
            print(f"(unknown command {line.split()[0]}: /reset /stats /quit; start with // to send a line that "
                  "begins with /)")
            continue
        try:
            prompt_ids, privacy = _encode(setup, args, _messages(args, history + [{"role": "user", "content": line}]))
        except ValueError as err:
            print(f"({err})")
            continue
        stream = TextStream(setup.tokenizer)
        if conversation is None:
            conversation = history_db.new_conversation(setup.target, setup.decoder.drafter.name)
        try:
            gen, text = _chat_turn(setup, args, history_db, conversation, line, prompt_ids, privacy, stream)
        except (ValueError, LinkDown, grpc.RpcError) as err:  # this turn fails; the conversation goes on
            reason = f"the verify service answered {err.code().name}: {err.details()}" \
                if isinstance(err, grpc.RpcError) else str(err)
            print(f"\n(no answer: {reason}; /reset starts a new conversation)")
            continue
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": text}]
        last_stats = gen.stats
        if gen.context_full:
            print(f"\n(the target's context of {setup.decoder.verifier.info.max_context} tokens is full: /reset "
                  "starts a new conversation)", end="")
        print()
    history_db.close()
    setup.decoder.verifier.close()
