"""`splitspec demo`: the main job end to end on real prompts.

Obtains the target, starts the verify service as a separate process on loopback, and generates
answers to a few Spec-Bench and HumanEval prompts through the split loop, streaming the text and
printing a stats line per answer.
"""
from __future__ import annotations

from dataclasses import replace

from splitspec.client.build import ClientConfig, build_client
from splitspec.client.stream import TextStream
from splitspec.shared.drafters.shipped import has_shipped_checkpoint
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.models import encode_chat, pull

from .prompts import load_prompts
from .service_process import free_port, sigterm_exits, start_server, stop_server


def demo_prompts(limit: int, spec_bench: str | None) -> list[dict]:
    """2 x `limit` Spec-Bench first turns spread over the categories, then `limit` HumanEval problems.

    Raises:
        ValueError: `limit` < 1, or no prompts (bench/prompts.py).
    """
    if limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    spec = load_prompts(["spec_bench"], 1, spec_bench)
    prompts = [spec[i] for i in range(0, len(spec), max(1, len(spec) // (2 * limit)))][: 2 * limit]
    return prompts + load_prompts(["humaneval"], limit)


def demo_drafter(name: str | None, target: str) -> tuple[DrafterSpec, bool]:
    """The demo's drafter (default auto) and whether the server runs its LSA. The shipped MoA
    drafter runs its LSA on the server: E values per token cross the wire, not every layer's K/V
    (20x fewer bytes, same drafts; docs/benchmarks.md, "Feature quantization and LSA placement"),
    unless the user chose a placement (`moa;lsa=client`)."""
    drafter = DrafterSpec.parse(name or "auto")
    on_server = (drafter.name in ("auto", "moa") and has_shipped_checkpoint(target)
                 and "lsa=" not in (name or ""))
    return (replace(drafter, lsa="server") if on_server else drafter), on_server


def cmd_demo(args) -> None:
    prompts = demo_prompts(args.limit, args.spec_bench)
    with sigterm_exits():
        _demo(args, prompts)


def _demo(args, prompts: list[dict]) -> None:
    pull(args.target)
    drafter, lsa_on_server = demo_drafter(args.drafter, args.target)
    port = free_port()
    print(f"starting the verify service for {args.target} on 127.0.0.1:{port} ...", flush=True)
    server = start_server(args.target, port, extra=["--lsa=moa"] if lsa_on_server else [])
    try:
        setup = build_client(ClientConfig(args.target, drafter, server=f"127.0.0.1:{port}"))
        print(f"mode: {setup.mode}, drafter: {setup.decoder.drafter.name}\n")
        for prompt in prompts:
            print(f"=== {prompt['dataset']} / {prompt['category']} / {prompt['id']}")
            print(f">>> {prompt['text'].strip()[:300]}\n")
            ids = encode_chat(setup.tokenizer, [{"role": "user", "content": prompt["text"]}])
            stream = TextStream(setup.tokenizer)
            gen = setup.decoder.generate(ids, args.max_new_tokens, setup.sampling, on_event=stream)
            stream.finish()
            print(f"\n{gen.stats.summary()}\n", flush=True)
        setup.decoder.verifier.close()
    finally:
        stop_server(server)
