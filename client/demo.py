"""`splitspec demo`: the main job end to end on real prompts.

Obtains the target, starts the verify service as a separate process on loopback, and generates
answers to a few Spec-Bench and HumanEval prompts through the split loop, streaming the text and
printing a stats line per answer.
"""
from __future__ import annotations

from splitspec.shared.models import DEFAULT_TARGET

from .bench import free_port, load_prompts, start_server


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="serve the target and answer real prompts through the split loop")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default=None, help="default: the generate command's default drafter")
    p.add_argument("--limit", type=int, default=1, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--spec-bench", default=None, help="path to Spec-Bench question.jsonl")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> None:
    from splitspec.shared.models import pull

    from .cli import TextStream, build_client, build_parser

    pull(args.target)
    spec = load_prompts(["spec_bench"], 1, args.spec_bench)
    prompts = [spec[i] for i in range(0, len(spec), max(1, len(spec) // (2 * args.limit)))][: 2 * args.limit]
    prompts += load_prompts(["humaneval"], args.limit)
    from .drafters import has_shipped_checkpoint

    drafter = args.drafter or "auto"
    # the shipped MoA drafter runs its LSA on the server: E values per token cross the wire, not every
    # layer's K/V (20x fewer bytes, same drafts; see the README's measured table)
    lsa_on_server = drafter in ("auto", "moa") and has_shipped_checkpoint(args.target)
    port = free_port()
    print(f"starting the verify service for {args.target} on 127.0.0.1:{port} ...", flush=True)
    server = start_server(args.target, port, extra=["--lsa=moa"] if lsa_on_server else [])
    try:
        client_argv = ["generate", "--server", f"127.0.0.1:{port}", "--target", args.target, "--prompt", "-",
                       "--max-new-tokens", str(args.max_new_tokens)]
        client_argv += ["--drafter", drafter] + (["--lsa-placement", "server"] if lsa_on_server else [])
        client_args = build_parser().parse_args(client_argv)
        setup = build_client(client_args)
        from splitspec.shared.models import encode_chat

        print(f"mode: {setup.mode}, drafter: {setup.decoder.drafter.name}\n")
        for prompt in prompts:
            print(f"=== {prompt['dataset']} / {prompt['category']} / {prompt['id']}")
            print(f">>> {prompt['text'].strip()[:300]}\n")
            ids = encode_chat(setup.tokenizer, [{"role": "user", "content": prompt["text"]}])
            gen = setup.decoder.generate(ids, args.max_new_tokens, setup.sampling, on_event=TextStream(setup.tokenizer))
            print(f"\n{gen.stats.summary()}\n", flush=True)
        setup.decoder.verifier.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
