"""`DrafterSpec`: a drafter named on the command line, parsed once into a frozen value.

Grammar (`generate --drafter`, `bench --methods`, `serve --lsa`, `offline-eval --drafters`):

    NAME[;lsa=client|server][;quant=fp16|int8|fp8][;vocab=N][;tree=DEPTHxTOPBxNODES|adaptive][;lookup=K]
        [;dtype=auto|float32|bfloat16]
    NAME = auto | none | ngram | draft-model:MODEL[@layers=N] | moa[:tli=N | :PATH] | eagle2[:PATH]
         | falcon[:PATH] | tokenswift[:PATH] | swift[:ratio=R]

`auto` is the MoA checkpoint shipped for the target (and fitting its @layers=N), else `ngram`; moa, eagle2, falcon and tokenswift without a PATH
use the checkpoint shipped for the target (shared/drafters/shipped.py); swift skips the share R of
the target's layers while drafting (training-free, client/drafters/swift.py). The options are MoA's LSA
placement, the features' quantization (the trained drafters), the draft vocabulary (the same: the N most
frequent tokens, 0 = full, -1 = the default) and the EAGLE-2 draft tree (`adaptive`: chosen each step
by the client's network-aware planner, client/tree_planner.py); `lookup=K` merges a prompt-lookup
chain of up to K tokens into each draft tree (0 = off; client/drafters/ngram.py,
`PromptLookupMerge`; -1, the default, is DEFAULT_LOOKUP for every drafter but none and ngram); `dtype` is what the
trained drafters compute in on the client (`auto`: bf16 where a bf16 matmul is measured faster, client/drafters/factory.py
`drafting_dtype`; drafts only, so the output stays the target's). Options left out take the
defaults the caller passes (the command's --lsa-placement, --feature-quant, ... flags).
The server uses the same grammar for the MoA checkpoints whose LSA it hosts, hence shared/.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from splitspec.shared.config import TreeConfig

from .shipped import default_checkpoint, has_shipped_checkpoint

KINDS = ("auto", "none", "ngram", "draft-model", "moa", "eagle2", "falcon", "tokenswift", "swift")
SELF_DRAFTING = ("moa", "eagle2", "falcon", "tokenswift")  # drafters built on the target's own frozen parts
LSA_PLACEMENTS = ("client", "server")
QUANTIZATIONS = ("fp16", "int8", "fp8")
OPTIONS = ("lsa", "quant", "vocab", "tree", "lookup", "dtype")
DRAFT_DTYPES = ("auto", "float32", "bfloat16")
DEFAULT_DRAFT_VOCAB = 8192  # vocab=-1: this many tokens when the target has shipped token counts, else full
# options of a drafter that runs a model on the target's features; none and ngram take none of them
MODEL_OPTIONS = ("lsa", "quant", "vocab", "dtype")
NO_LOOKUP = ("none", "ngram")  # kinds that take no prompt-lookup chain (ngram is prompt lookup)
DEFAULT_LOOKUP = 8  # lookup=-1: chains of up to 8 tokens (56 Spec-Bench prompts: moa 1.16x -> 1.33x generate())


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter and its options; `parse` reads the grammar above and `str` writes it back.

    kind: one of KINDS. model: draft-model's MODEL[@layers=N]. tli: moa's shipped checkpoint
    moa-tli<N>. path: a moa / eagle2 / falcon / tokenswift checkpoint folder instead of the shipped one. ratio: swift's
    share of skipped layers (None = SwiftConfig's default).

    Raises:
        ValueError: an unknown kind, a missing or misplaced argument, an option out of range.
    """

    kind: str
    model: str | None = None
    tli: int | None = None
    path: str | None = None
    ratio: float | None = None
    lsa: str = "client"  # MoA: Layer Self-Attention on this device or on the server
    quant: str = "int8"  # quantization of the features the server sends (int8 absmax: half fp16's bytes at the
    # same drafts for the shipped moa on 28 Spec-Bench prompts, eagle2 -0.02 tau unresolved; session 44)
    vocab: int = -1  # draft vocabulary size: -1 = DEFAULT_DRAFT_VOCAB when counts ship, 0 = full
    tree: TreeConfig = TreeConfig()
    adaptive: bool = False  # tree=adaptive: the client picks each step's tree (TreePlanner), from `tree` on
    lookup: int = -1  # prompt-lookup chain merged into draft trees: up to this many tokens; 0 = off, -1 = default
    dtype: str = "auto"  # what a trained drafter computes in (DRAFT_DTYPES; auto: bf16 where measured faster)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown drafter {self.kind!r}; expected none, ngram, draft-model:MODEL[@layers=N], "
                             "moa[:tli=N|:PATH], eagle2[:PATH], falcon[:PATH], tokenswift[:PATH] or swift[:ratio=R]")
        if (self.kind == "draft-model") != bool(self.model):
            raise ValueError("draft-model needs a model: draft-model:MODEL[@layers=N]" if self.kind == "draft-model"
                             else f"{self.kind} takes no model")
        if (self.tli is not None and self.kind != "moa") or (self.path and self.kind not in SELF_DRAFTING):
            raise ValueError(f"{self.kind} takes no tli= or checkpoint path")
        if self.ratio is not None and (self.kind != "swift" or not 0.0 <= self.ratio < 1.0):
            raise ValueError(f"swift:ratio=R needs 0 <= R < 1 (and only swift takes it), got {self.ratio}")
        if self.tli is not None and self.tli < 0:
            raise ValueError(f"moa:tli=N needs N >= 0, got {self.tli}")
        if self.lsa not in LSA_PLACEMENTS or self.quant not in QUANTIZATIONS:
            raise ValueError(f"{self.name!r}: lsa must be client|server and quant fp16|int8|fp8")
        if self.vocab < -1:
            raise ValueError(f"{self.name!r}: the draft vocabulary (--draft-vocab, ;vocab=) must be >= 0 "
                             f"(0: the full vocabulary), or -1 for the default; got {self.vocab}")
        if self.lookup < -1:
            raise ValueError(f"{self.name!r}: lookup must be >= 0 (0 = off)")
        if self.dtype not in DRAFT_DTYPES:
            raise ValueError(f"{self.name!r}: dtype must be one of {', '.join(DRAFT_DTYPES)}, got {self.dtype!r}")
        if self.lookup > 0 and self.kind in NO_LOOKUP:
            raise ValueError(f"{self.kind} takes no lookup= (ngram is prompt lookup; none drafts nothing)")

    @classmethod
    def parse(cls, text: str, *, options: tuple[str, ...] = OPTIONS, flags: dict[str, str] | None = None,
              **defaults) -> "DrafterSpec":
        """Parse `text`; `defaults` (lsa, quant, vocab, tree) fill the options it leaves out.

        `flags` maps the defaults the user set by hand to the flag that set them (`{"lsa":
        "--lsa-placement"}`): like an option written in `text`, such a flag is refused where this
        drafter does nothing with it (a command with one drafter; bench's flags apply to many).

        Raises:
            ValueError: bad grammar, an option not among `options`, or an option or flag this drafter
                does not use.
        """
        name, *pairs = text.strip().split(";")
        try:
            given = dict(pair.split("=", 1) for pair in pairs)
        except ValueError:
            raise ValueError(f"drafter options are key=value, got {text!r}") from None
        unknown = set(given) - set(options)
        if unknown:
            raise ValueError(f"unknown drafter options {sorted(unknown)} in {text!r}; expected "
                             + ", ".join(f"{o}=" for o in options))
        spec = replace(cls(**_name_fields(name), **defaults), **_option_fields(given, text))
        # an option that does nothing for this drafter, given explicitly, is refused: it made a second
        # bench arm of the same drafter, or a user believe it applied (QA 57)
        unused = _idle_options(spec.kind)
        idle = {key: why for key, why in unused.items() if key in given}
        if idle:
            raise ValueError(f"{spec.kind} takes no {', '.join(k + '=' for k in idle)} in {text!r} "
                             f"({'; '.join(dict.fromkeys(idle.values()))})")
        idle = {flag: unused[key] for key, flag in (flags or {}).items() if key in unused}
        if idle:
            raise ValueError(f"{', '.join(idle)} does nothing for the drafter {spec.kind} "
                             f"({'; '.join(dict.fromkeys(idle.values()))})")
        return spec

    @property
    def name(self) -> str:
        """The drafter without its options: `moa:tli=1`, `draft-model:MODEL`, `eagle2:PATH`."""
        arg = self.model or self.path or (f"tli={self.tli}" if self.tli is not None else "")
        arg = arg or (f"ratio={self.ratio:g}" if self.ratio is not None else "")
        return f"{self.kind}:{arg}" if arg else self.kind

    def __str__(self) -> str:
        """The name and every option that differs from the class defaults."""
        defaults = DrafterSpec("none")
        words = [self.name]
        words += [f"{key}={getattr(self, key)}" for key in ("lsa", "quant", "vocab", "lookup", "dtype")
                  if getattr(self, key) != getattr(defaults, key)]
        if self.adaptive:
            words.append("tree=adaptive")
        elif self.tree != defaults.tree:
            words.append(f"tree={self.tree.depth}x{self.tree.top_b}x{self.tree.max_nodes}")
        return ";".join(words)

    @property
    def lookup_depth(self) -> int:
        """Tokens of the prompt-lookup chain merged into each draft tree (0 = none): `lookup`, or
        DEFAULT_LOOKUP when it is -1, for every kind but none and ngram (and auto before `resolve`)."""
        if self.kind in NO_LOOKUP:
            return 0
        return DEFAULT_LOOKUP if self.lookup == -1 else self.lookup

    def resolve(self, target: str | None) -> "DrafterSpec":
        """`auto` made concrete: moa when a checkpoint ships for `target` and fits it (for
        `MODEL@layers=N`, one trained for N layers: `has_shipped_checkpoint`), else ngram."""
        if self.kind != "auto":
            return self
        if has_shipped_checkpoint(target):
            return replace(self, kind="moa")
        return replace(self, kind="ngram", lookup=-1)  # ngram is prompt lookup already

    def checkpoint(self, target: str) -> Path:
        """The checkpoint folder of a trained drafter (SELF_DRAFTING) for `target`.

        Raises:
            ValueError: not one of those.
            FileNotFoundError: no path was given and none ships for `target` (which ones do is
                listed, with how to train the missing one).
        """
        if self.kind not in SELF_DRAFTING:
            raise ValueError(f"{self.name!r} is not a trained drafter ({', '.join(SELF_DRAFTING)})")
        if self.path:
            return Path(self.path)
        path = default_checkpoint(target, self.kind, self.tli or 0)
        if not (path / "drafter.json").exists():
            shipped = sorted(p.parent.name for p in path.parent.glob("*/drafter.json")) or ["none"]
            raise FileNotFoundError(
                f"no {self.name} checkpoint ships for {target} (shipped: {', '.join(shipped)}); train one with "
                f"`splitspec train --drafter {self.name} --target {target} --out DIR` and name it "
                f"{self.kind}:DIR")
        return path


def _name_fields(name: str) -> dict:
    """kind and argument fields of NAME (see the module docstring)."""
    kind, _, arg = name.partition(":")
    if not arg:
        return {"kind": kind}
    if kind == "draft-model":
        return {"kind": kind, "model": arg}
    if kind == "moa" and arg.startswith("tli="):
        try:
            return {"kind": kind, "tli": int(arg.removeprefix("tli="))}
        except ValueError:
            raise ValueError(f"moa:tli=N needs an integer, got {name!r}") from None
    if kind == "swift":
        try:
            if not arg.startswith("ratio="):
                raise ValueError
            return {"kind": kind, "ratio": float(arg.removeprefix("ratio="))}
        except ValueError:
            raise ValueError(f"swift takes only ratio=R (a share of layers in [0, 1)), got {name!r}") from None
    return {"kind": kind, "path": arg}


def _idle_options(kind: str) -> dict[str, str]:
    """The options that do nothing for drafters of `kind`, each with why."""
    idle = {}
    if kind in NO_LOOKUP:
        idle |= {key: "none drafts nothing" if kind == "none" else "ngram runs no model" for key in MODEL_OPTIONS}
        if kind == "none":
            idle["tree"] = "none drafts nothing"
    if kind not in (*SELF_DRAFTING, "auto", *NO_LOOKUP):
        idle["vocab"] = "the draft vocabulary (FR-Spec) is for moa, eagle2, falcon and tokenswift"
    if kind not in ("moa", "auto", *NO_LOOKUP):
        idle["lsa"] = "LSA placement is MoA's"
    return idle


def _option_fields(given: dict[str, str], text: str) -> dict:
    """lsa / quant / vocab / tree / lookup / dtype fields from the key=value options of `text`."""
    fields = {key: given[key] for key in ("lsa", "quant", "dtype") if key in given}
    try:
        if "vocab" in given:
            fields["vocab"] = int(given["vocab"])
        if "lookup" in given:
            fields["lookup"] = int(given["lookup"])
        if given.get("tree") == "adaptive":
            fields["adaptive"] = True
        elif "tree" in given:
            sizes = given["tree"].split("x")
            if len(sizes) != 3:
                raise ValueError
            fields["tree"] = TreeConfig(*map(int, sizes))
    except ValueError:
        raise ValueError(f"{text!r}: vocab and lookup are integers (0 = full vocabulary / no lookup) and tree "
                         "is DEPTHxTOPBxNODES, each >= 1, or adaptive") from None
    return fields
