"""`splitspec bench`: every method side by side in one run, so only same-run ratios are compared.

For each prompt (Spec-Bench first turns by category, HumanEval problems) it runs, back to back:
plain `generate()` on the target (single-device autoregressive, the baseline), the single-device
reference methods (`--local-methods`), then, for every link profile (`--profiles`), each split
method (`--methods`) against one verify service process reached through that profile's emulated
link. Greedy decoding by default: every method must produce the baseline's tokens, and the run
says if one did not. With `--temperature` > 0 every method and the baseline sample instead (answer
i seeded with --seed + i, transformers' own warpers for the baseline); answers are then not
compared, since losslessness under sampling is a property of the distribution (tested in tests/),
and the speed-ups are those of a chat client that samples. Client and server share this machine's cores, each with a pinned torch thread count; the
figures are ratios within the run, never absolute claims. Metrics: bench/metrics.py; tables and
plots: bench/report.py; the command line: bench/cli.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from splitspec.client.drafters.factory import make_drafter
from splitspec.client.loop import SpeculativeDecoder
from splitspec.client.tree_planner import TreePlanner
from splitspec.client.transport import RemoteVerifier, load_client_security
from splitspec.netsim import load_profile
from splitspec.netsim.schedule import ProfileSwitching, ScheduledSwitches
from splitspec.netsim.backends import RelayBackend
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner, context_length
from splitspec.shared.config import ServerLimits
from splitspec.shared.drafters.spec import SELF_DRAFTING, DrafterSpec
from splitspec.shared.models import cpu_model, encode_chat, eos_token_ids, load_model
from splitspec.shared.records import AnswerRecord
from splitspec.shared.reference import target_greedy, target_sampled
from splitspec.shared.sampling import SamplingParams

from .cli import BACKENDS
from .metrics import BASELINE, BenchRecord, token_gaps_ms
from .out_paths import writable_dir
from .prompts import load_prompts
from .report import PLOTS, inexact_answers, render_markdown, write_plots
from .service_process import free_port, sigterm_exits, start_server, stop_server

WARMUP_TOKENS = 4
DEFAULT_GOAL_PROFILE = "4g"  # the goals are stated under 4g
LOCAL_OPTIONS = ("vocab", "tree", "lookup", "dtype")  # ;lsa= and ;quant= only exist with a server


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
    goal_profile: str | None  # None: DEFAULT_GOAL_PROFILE, whether or not the run has it (`goal`)
    out: Path | None
    sampling: SamplingParams = SamplingParams()  # greedy by default; answer i samples with seed + i

    @classmethod
    def from_args(cls, args) -> "BenchConfig":
        """Raises ValueError: bad counts, bad sampling settings, a method, profile, dataset or category
        listed twice, unknown method options, options on single-device methods, unknown link profiles,
        a profile that cuts the link (loss 100%: no answer could cross it), a --goal-profile given but
        not among the run's profiles; FileNotFoundError: a profile .toml that does not exist."""
        threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 2) // 2)
        if threads < 1 or args.limit < 1 or args.max_new_tokens < 1:
            raise ValueError("--threads, --limit and --max-new-tokens must be >= 1")
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        cfg = cls(args.target, _csv(args.methods), _csv(args.local_methods), _csv(args.profiles), args.backend,
                  args.seed, threads, _csv(args.datasets), _csv(args.categories), args.limit, args.max_new_tokens,
                  args.spec_bench, args.lsa_placement, args.feature_quant, args.goal_profile,
                  Path(args.out) if args.out else None, sampling)
        for flag, values in (("--methods", cfg.methods), ("--local-methods", cfg.local_methods),
                             ("--profiles", cfg.profiles), ("--datasets", cfg.datasets),
                             ("--categories", cfg.categories)):
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:  # the arms (or prompts) of a repeat would be pooled into one row
                raise ValueError(f"{flag} lists {', '.join(twice)} more than once")
        for m in cfg.methods:
            cfg.split_spec(m)
        for m in cfg.local_methods:
            cfg.local_spec(m)
        names = []
        for spec in cfg.profiles:  # fail before any model is loaded
            profile, _, phases = link_profiles(spec)
            cut = [p.name for p in (profile, *phases) if p.offline]
            if cut:
                raise ValueError(f"--profiles {spec}: {', '.join(dict.fromkeys(cut))} cuts the link (loss 100%), so no "
                                 "answer could cross it; offline answers are measured by `splitspec offline-eval`")
            names.append(profile.name)
        run_profiles = (names or ["loopback"]) if cfg.methods else []
        if cfg.goal_profile is not None and cfg.goal_profile not in run_profiles:
            raise ValueError(f"--goal-profile {cfg.goal_profile} is not a profile of this run "
                             f"({', '.join(run_profiles) or 'no split methods'}); add it to --profiles")
        return cfg

    @property
    def goal(self) -> str:
        """The profile the goal lines are checked under."""
        return self.goal_profile or DEFAULT_GOAL_PROFILE

    def split_spec(self, method: str) -> DrafterSpec:
        """A split method's drafter, --lsa-placement and --feature-quant filling what it leaves out.

        Raises:
            ValueError: bad drafter grammar (shared/drafters/spec.py).
        """
        return DrafterSpec.parse(method, lsa=self.lsa_placement, quant=self.feature_quant)

    @staticmethod
    def local_spec(method: str) -> DrafterSpec:
        """A single-device method's drafter: only ;vocab= and ;tree= options.

        Raises:
            ValueError: bad grammar, or ;lsa= / ;quant= (they only exist with a server).
        """
        try:
            return DrafterSpec.parse(method, options=LOCAL_OPTIONS)
        except ValueError as err:
            raise ValueError(f"single-device method {method!r}: {err} (;lsa= and ;quant= only exist with a "
                             "server)") from None

    def command(self) -> str:
        """The command line that repeats this run (every option spelled out)."""
        opts = {"--target": self.target, "--methods": ",".join(self.methods),
                "--local-methods": ",".join(self.local_methods), "--profiles": ",".join(self.profiles),
                "--backend": self.backend, "--seed": self.seed, "--threads": self.threads,
                "--datasets": ",".join(self.datasets), "--categories": ",".join(self.categories),
                "--limit": self.limit, "--max-new-tokens": self.max_new_tokens, "--spec-bench": self.spec_bench,
                "--lsa-placement": self.lsa_placement, "--feature-quant": self.feature_quant,
                "--goal-profile": self.goal_profile, "--out": self.out}
        if not self.sampling.greedy:
            opts |= {"--temperature": self.sampling.temperature, "--top-p": self.sampling.top_p,
                     "--top-k": self.sampling.top_k}
        words = ["splitspec", "bench"]
        for flag, value in opts.items():
            # an empty method list means none, and leaving the flag out would mean the defaults
            if value not in (None, "") or flag in ("--methods", "--local-methods"):
                words += [flag, str(value)]
        return shlex.join(words)


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def link_profiles(spec: str, seed: int = 0):
    """(the LinkProfile a link starts with, its ProfileSwitching or None, the profiles it switches
    between) for a --profiles entry: a preset, a .toml file, or `A~B/PERIOD` (netsim/schedule.py),
    whose starting profile is A renamed to the whole spec, so results carry it.

    Raises:
        ValueError: an unknown profile or a malformed switching spec.
    """
    switching = ProfileSwitching.parse(spec)
    if switching is None:
        return load_profile(spec).with_seed(seed), None, ()
    phases = [load_profile(name).with_seed(seed) for name in switching.names]
    return replace(phases[0], name=switching.name), switching, phases


@contextlib.contextmanager
def open_link(backend: str, profile, upstream: tuple[str, int], switching=None,
              phases=()) -> Iterator[tuple[str, ScheduledSwitches | None]]:
    """Put an emulated link with `profile` (a LinkProfile) in front of `upstream` (host, port) and
    yield (the HOST:PORT a client dials to cross it, its ScheduledSwitches or None); the link is
    torn down on exit. The relay runs in its own process, so the client's Python threads (drafting)
    cannot delay it. With `switching` the link alternates between `phases` every period
    (`run_arm` restarts the sequence at each answer).

    Raises:
        ValueError: a backend this bench cannot drive (tun and netem need the server inside a
            network namespace: not wired yet).
    """
    if backend != "relay":
        raise ValueError(f"link backend {backend!r} is not supported by bench; available: {', '.join(BACKENDS)}")
    with RelayBackend(profile, listen_host=upstream[0], own_process=True) as link:
        address = link.expose(upstream[1])
        if switching is None:
            yield address, None
            return
        with ScheduledSwitches(link, switching, phases) as switches:
            yield address, switches


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
    switches: ScheduledSwitches | None = None  # a link switching profiles, restarted at each answer

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
    """The bench command (module docstring).

    Raises:
        ValueError, FileNotFoundError, OSError: bad arguments, prompts or --out, before any model loads.
        RuntimeError: a greedy answer differed from generate()'s (after the report is printed and written).
    """
    cfg = BenchConfig.from_args(args)
    if cfg.out:
        writable_dir(cfg.out)
        earlier = [cfg.out / name for name in OUTPUTS if (cfg.out / name).exists()]
        if earlier and not args.overwrite:
            raise ValueError(f"{cfg.out} holds an earlier run ({', '.join(p.name for p in earlier)}): --overwrite "
                             "replaces it, or choose another --out")
        for path in earlier:  # none of the earlier run's files may stay beside this run's
            path.unlink()
    prompts = load_prompts(list(cfg.datasets), cfg.limit, cfg.spec_bench, cfg.categories)
    torch.set_num_threads(cfg.threads)
    records: list[BenchRecord] = []  # filled answer by answer, so that an interrupted run keeps what it measured
    try:
        with sigterm_exits():
            model, tokenizer, model_id = load_model(cfg.target)
            check_prompts_fit(prompts, model, tokenizer, cfg.max_new_tokens, split=bool(cfg.methods))
            meta = {"target": model_id, "commit": source_commit(), "machine": machine_description(cfg.threads),
                    "seed": cfg.seed, "threads": cfg.threads, "max_new_tokens": cfg.max_new_tokens,
                    "decoding": decoding_text(cfg.sampling)}
            with contextlib.ExitStack() as stack:
                arms = build_arms(cfg, stack, model, tokenizer, model_id)
                records = run_arms(cfg, prompts, arms, model, tokenizer, meta, records)
    except (KeyboardInterrupt, SystemExit):
        keep_interrupted(cfg, records)
        raise
    except Exception:  # an answer failed (a refusal, a bug): the error is reported, the answers before it kept
        if records:
            keep_interrupted(cfg, records, "stopped by the error below")
        raise
    table = render_markdown(records, meta, cfg)
    print(table)
    lossy = inexact_answers(records)
    if lossy:
        print(lossy, file=sys.stderr)
    # what adaptive drafters settled on (SWIFT: its skip-set search) and what prompt lookup added
    reports = {arm.label: report for arm in arms if (report := _adaptive_report(arm.decoder))}
    for label, report in reports.items():
        if "planner" in report:
            print(f"{label}: trees chosen {report['planner']['chosen']}", file=sys.stderr)
        if "lookup_steps" in report:
            print(f"{label}: prompt lookup added {report['lookup_nodes']} nodes over {report['lookup_steps']} steps, "
                  f"{report['lookup_accepted']} of them accepted", file=sys.stderr)
        if "best" in report:
            print(f"{label}: skips layers {report['best']} (matchness {report['best_matchness']:.3f} after "
                  f"{report['steps']} search steps)", file=sys.stderr)
    if cfg.out:
        cfg.out.mkdir(parents=True, exist_ok=True)
        write_results(cfg.out, records)
        (cfg.out / "table.md").write_text(table + "\n")
        if reports:
            (cfg.out / "drafters.json").write_text(json.dumps(reports, indent=1) + "\n")
        for path in write_plots(records, cfg.out, list(_profile_names(records))):
            print(f"wrote {path}", file=sys.stderr)
    if lossy:
        raise RuntimeError("greedy answers differ from generate()'s (see the WARNING above): the run is not lossless")


def _adaptive_report(decoder) -> dict:
    """What a decoder's adaptive parts settled on: the drafter's report (SWIFT's search) and the
    network-aware planner's, if any."""
    report = dict(getattr(getattr(decoder, "drafter", None), "report", dict)())
    planner = getattr(decoder, "planner", None)
    if planner is not None:
        report["planner"] = planner.report()
    return report


def build_arms(cfg: BenchConfig, stack: contextlib.ExitStack, model, tokenizer, model_id) -> list[Arm]:
    """The local arms, then one server process and, per profile, a link and the split arms.
    Everything started is registered on `stack` for teardown."""
    local = LocalVerifier(TargetRunner(model, tokenizer, model_id))
    fingerprint = local.info.tokenizer_fingerprint

    def drafter(spec: DrafterSpec):
        return make_drafter(spec, target_fingerprint=fingerprint, target=cfg.target, target_model=model,
                            seed=cfg.seed)

    def decoder(verifier, spec: DrafterSpec, built=None):
        return SpeculativeDecoder(verifier, built or drafter(spec), planner=TreePlanner() if spec.adaptive else None)

    arms = [Arm("local", m, decoder(local, cfg.local_spec(m))) for m in cfg.local_methods]
    if not cfg.methods:
        return arms
    specs = {m: cfg.split_spec(m) for m in cfg.methods}
    links = [(spec, cfg.backend) for spec in cfg.profiles] or [(None, None)]
    hosted = sorted({f"--lsa={s.name}" for s in specs.values() if s.lsa == "server" and s.kind == "moa"})
    port = free_port()
    server = start_server(cfg.target, port, extra=hosted, threads=cfg.threads)
    stack.callback(stop_server, server)
    drafters = {m: drafter(specs[m]) for m in cfg.methods}  # one per method, reset for every answer
    for spec, backend in links:
        profile, switching, phases = link_profiles(spec, cfg.seed) if spec else (None, None, ())
        address, switches = (stack.enter_context(open_link(backend, profile, ("127.0.0.1", port), switching, phases))
                             if profile else (f"127.0.0.1:{port}", None))
        verifier = RemoteVerifier(address, **load_client_security())  # $SPLITSPEC_AUTH_TOKEN if the server wants one
        stack.callback(verifier.close)
        for m in cfg.methods:
            spec = specs[m]
            arms.append(Arm("split", m, decoder(verifier, spec, drafters[m]),  # a planner per link when adaptive
                            profile=profile.name if profile else "loopback", backend=backend,
                            link=profile.to_dict() if profile else None, lsa=spec.lsa if spec.kind == "moa" else None,
                            quant=spec.quant if spec.kind in SELF_DRAFTING else None, switches=switches))
    return arms


# what a run writes into --out (plots only with split rows, drafters.json only with adaptive drafters)
OUTPUTS = ("results.jsonl", "table.md", "drafters.json", *PLOTS)


def write_results(out: Path, records: list[BenchRecord]) -> None:
    """--out/results.jsonl: one JSON record per answer (bench/metrics.py `BenchRecord.to_json`)."""
    (out / "results.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))


def keep_interrupted(cfg: BenchConfig, records: list[BenchRecord], why: str = "interrupted") -> None:
    """After Ctrl-C, SIGTERM or an error (`why`): write the answers finished so far to
    --out/results.jsonl (no table or plots: the arms would be compared over different prompts) and
    say so on stderr."""
    if not records:
        print(f"bench: {why} before the first answer was measured", file=sys.stderr)
        return
    if not cfg.out:
        print(f"bench: {why} after {len(records)} answers (nothing kept: no --out)", file=sys.stderr)
        return
    write_results(cfg.out, records)
    print(f"bench: {why}; the {len(records)} answers finished are in {cfg.out / 'results.jsonl'} "
          "(no table: rerun for one)", file=sys.stderr)


def check_prompts_fit(prompts: list[dict], model, tokenizer, max_new_tokens: int, split: bool) -> None:
    """Raises ValueError, before anything is measured, naming the prompts whose chat-rendered tokens
    and `max_new_tokens` do not fit the target `model`'s context (as the verify service takes it,
    server/runner.py `context_length`) or, with `split` arms, that are over the
    verify service's max_prompt_tokens. A run that reached such a prompt failed there (QA 58), or,
    where the prompt left a little room, every arm's answer stopped at the full context while
    generate()'s ran on, and the run was failed as lossy after all its measuring (the review)."""
    context, over = context_length(model.config), []
    for p in prompts:
        n = len(encode_chat(tokenizer, [{"role": "user", "content": p["text"]}]))
        if n + max_new_tokens > context or (split and n > ServerLimits.max_prompt_tokens):
            over.append((p, n))
    if over:
        named = ", ".join(f"{p['category']}/{p['id']} ({n} tokens)" for p, n in over[:5])
        where = f"; a split prompt at most {ServerLimits.max_prompt_tokens}" if split else ""
        raise ValueError(f"{len(over)} of the {len(prompts)} prompts do not fit (the target's context is {context} "
                         f"tokens, prompt and --max-new-tokens {max_new_tokens} together{where}): {named}"
                         f"{', ...' if len(over) > 5 else ''}; leave out their --categories, lower --max-new-tokens "
                         "or use a target with a longer context")


def run_arms(cfg: BenchConfig, prompts: list[dict], arms: list[Arm], model, tokenizer,
             meta: dict, records: list[BenchRecord] | None = None) -> list[BenchRecord]:
    """Warm every arm up once, then run generate() and every arm on each prompt in turn.
    Returns one record per prompt x arm (generate() included); see bench/metrics.py. Each record is
    appended to `records` (a new list when None) as soon as it is measured."""
    eos = list(eos_token_ids(model, tokenizer))
    warm = encode_chat(tokenizer, [{"role": "user", "content": "Hello."}])
    run_baseline(model, warm, WARMUP_TOKENS, eos, cfg.sampling)
    for arm in arms:
        arm.decoder.generate(warm, WARMUP_TOKENS, cfg.sampling)
    records = [] if records is None else records
    with tqdm(total=len(prompts) * (1 + len(arms)), desc="bench", unit="answer", file=sys.stderr) as bar:
        for i, prompt in enumerate(prompts):
            ids = encode_chat(tokenizer, [{"role": "user", "content": prompt["text"]}])
            facts = {**meta, "dataset": prompt["dataset"], "prompt_tokens": len(ids)}
            sampling = cfg.sampling if cfg.sampling.greedy else replace(cfg.sampling, seed=cfg.sampling.seed + i)
            bar.set_postfix_str(f"{prompt['category']} generate()")
            ref, record = run_baseline(model, ids, cfg.max_new_tokens, eos, sampling)
            records.append(replace(record, category=prompt["category"], id=prompt["id"],
                                   details={**facts, **record.details}))
            bar.update()
            for arm in arms:
                bar.set_postfix_str(f"{prompt['category']} {arm.label}")
                record = run_arm(arm, ids, cfg.max_new_tokens, ref, sampling)
                records.append(replace(record, category=prompt["category"], id=prompt["id"],
                                       details={**facts, **record.details}))
                bar.update()
    return records


def answer_digest(tokens: list[int]) -> str:
    """A fingerprint of an answer's token ids: 16 hex digits of SHA-1 over them, written to
    results.jsonl as `answer_digest` so that two runs, or two arms, can be compared answer by answer
    (a seeded sampled run against its repeat) without the text."""
    return hashlib.sha1(json.dumps(list(tokens)).encode()).hexdigest()[:16]


def run_baseline(model, ids: list[int], max_new_tokens: int, eos: list[int],
                 sampling: SamplingParams = SamplingParams()) -> tuple[list[int], BenchRecord]:
    """generate() on the target alone: its answer [N] and its record (one target call per token).
    Sampled (`sampling` not greedy) with transformers' own warpers, seeded with `sampling.seed`."""
    clock = ArrivalClock(streamer=True)
    out = target_greedy(model, ids, max_new_tokens, eos, streamer=clock) if sampling.greedy else \
        target_sampled(model, ids, max_new_tokens, eos, sampling, streamer=clock)
    elapsed = time.perf_counter() - clock.start
    latencies = clock.latencies()
    answer = AnswerRecord(len(out), len(out), round(elapsed, 4))
    return out, BenchRecord("local", BASELINE, None, "", "", answer, tuple(latencies["itl_ms"]), latencies["ttft_ms"],
                            True if sampling.greedy else None,  # a sample is nobody's reference
                            details={"tokens_per_s": round(len(out) / elapsed, 3), "tau": 1.0,
                                     "answer_digest": answer_digest(out)})


def run_arm(arm: Arm, ids: list[int], max_new_tokens: int, reference: list[int],
            sampling: SamplingParams = SamplingParams()) -> BenchRecord:
    """One answer of one arm: its stats, latencies and whether it equals `reference` [N] (None when
    sampled: a sampled answer need not equal another sample)."""
    if arm.switches is not None:  # every method meets the link's changes at the same moments of its answer
        arm.switches.restart()
    clock = ArrivalClock()
    gen = arm.decoder.generate(ids, max_new_tokens, sampling, on_tokens=clock)
    s = gen.stats
    answer = replace(s.record(), elapsed_s=round(s.elapsed_s, 3), server_ms=round(s.server_ms, 3))
    latencies = clock.latencies()
    details = {**s.as_dict(), "server_forward_ms": round(sum(c.server_forward_ms for c in s.calls), 3),
               "rtt_ms": round(s.rtt_ms, 3), "answer_digest": answer_digest(gen.tokens)}
    return BenchRecord(arm.mode, arm.method, arm.profile, "", "", answer, tuple(latencies["itl_ms"]),
                       latencies["ttft_ms"], gen.tokens == reference if sampling.greedy else None, arm.backend,
                       arm.link, arm.lsa, arm.quant,
                       details)


def decoding_text(sampling: SamplingParams) -> str:
    """'greedy', or the sampling settings in words (the report's header)."""
    if sampling.greedy:
        return "greedy"
    return f"sampled ({sampling.describe()}, answer i seeded {sampling.seed} + i)"


def _profile_names(records: list[BenchRecord]) -> Iterator[str]:
    return iter(dict.fromkeys(r.profile for r in records if r.mode == "split"))


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
    return (f"{cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, "
            f"torch {torch.__version__}, CPU inference, {threads} torch thread(s) per process")
