"""Hostile and careless input, table-driven: each case is a row (what is set up, what b70ctl is asked, the exit
code and the words the one-line error must hold). Every row also checks that nothing was written outside the
place the command owns and that nothing half-written stayed (hostile.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from b70ctl.lock.model import FilePin, ImagePin, ModelPin, PatchSeriesPin, build_lock, lock_document
from hostile import Invocation, assert_left_clean, assert_one_line_error, run_b70ctl, snapshot
from store_fixtures import (  # noqa: F401 (fixtures)
    DRAFTER_REPO,
    IMAGE_REFERENCE,
    TARGET_REPO,
    drafter_files,
    registry,
    sha256,
    target_files,
    write_recipe,
)


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Path], Invocation]
    exit_code: int
    message: str  # regex the one error line must match


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Nothing a case does may touch the real user's cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")


def run_case(case: Case, tmp_path: Path) -> None:
    work = tmp_path / "case"
    work.mkdir()
    invocation = case.build(work)
    before = snapshot(tmp_path)
    outcome = run_b70ctl(invocation.args, invocation.env, invocation.stdin)
    assert_one_line_error(outcome, case.exit_code, case.message)
    assert_left_clean(tmp_path, before, invocation.may_write + [tmp_path / "xdg-cache", tmp_path / "hf-home"])


# --- locks and fetch: paths from a lock must stay inside their root -----------------------------------------


def _store(work: Path, target: dict[str, bytes] | None = None) -> tuple[Path, Path]:
    """A recipe file, and a local source directory holding target/ and drafter/."""
    recipe = write_recipe(work)
    source = work / "source"
    for role, files in (("target", target or target_files()), ("drafter", drafter_files())):
        for name, data in files.items():
            (source / role / name).parent.mkdir(parents=True, exist_ok=True)
            (source / role / name).write_bytes(data)
    return recipe, source


def _lock_data(target_paths: dict[str, bytes] | None = None) -> dict:
    """A resolved lock for store_fixtures' recipe, as JSON data (so a case can tamper with it)."""
    def pins(files: dict[str, bytes]) -> list[FilePin]:
        return [FilePin(path=name, sha256=sha256(data), size_bytes=len(data)) for name, data in sorted(files.items())
                if name != "README.md"]

    target_files_ = {k: v for k, v in target_files().items() if k != "README.md"}
    lock = build_lock(
        recipe="store-test", vllm_version="0.32.0",
        image=ImagePin(reference=IMAGE_REFERENCE, tag="v1", source="pull", digest="sha256:" + "1" * 64,
                       resolved=True),
        patch_series=PatchSeriesPin(applicable=False, resolved=True),
        target=ModelPin(role="target", repo=TARGET_REPO, requested_revision="main",
                        include=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"], revision="a" * 40,
                        files=pins(target_files_), resolved=True),
        drafter=ModelPin(role="drafter", repo=DRAFTER_REPO, requested_revision="main",
                         include=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"], revision="b" * 40,
                         files=pins(drafter_files()), resolved=True))
    return json.loads(lock_document(lock))


def _tampered_fetch(bad_path: str) -> Callable[[Path], Invocation]:
    """A lock whose target lists `bad_path` (with the bytes of tokenizer.json); the local source holds those
    bytes where the bad path leads, so an unchecked fetch would write them there."""
    def build(work: Path) -> Invocation:
        recipe, source = _store(work)
        data = _lock_data()
        tokenizer = target_files()["tokenizer.json"]
        data["target"]["files"].append({"path": bad_path, "sha256": sha256(tokenizer), "size_bytes": len(tokenizer)})
        lock = work / "store-test.lock.json"
        lock.write_text(json.dumps(data))
        planted = Path(os.path.normpath(source / "target" / bad_path.replace("\\", "/")))
        if "\x00" not in bad_path and planted.is_relative_to(work) and not planted.exists():
            planted.parent.mkdir(parents=True, exist_ok=True)
            planted.write_bytes(tokenizer)
        return Invocation(["model", "fetch", "--recipe", str(recipe), "--dest", str(work / "dest" / "models"),
                           "--source", "local", "--source-dir", str(source), "--lock", str(lock)])
    return build


def _tampered_check(bad_path: str) -> Callable[[Path], Invocation]:
    def build(work: Path) -> Invocation:
        recipe, source = _store(work)
        data = _lock_data()
        data["drafter"]["files"][0]["path"] = bad_path
        lock = work / "store-test.lock.json"
        lock.write_text(json.dumps(data))
        return Invocation(["lock", "check", "--recipe", str(recipe), "--lock", str(lock), "--models-dir",
                           str(source)])
    return build


def _symlink_escape(work: Path) -> Invocation:
    """A plain path in the lock, but DEST/target/sub is a link to a directory outside DEST."""
    recipe, source = _store(work)
    data = _lock_data()
    tokenizer = target_files()["tokenizer.json"]
    data["target"]["files"].append({"path": "sub/extra.json", "sha256": sha256(tokenizer),
                                    "size_bytes": len(tokenizer)})
    (source / "target" / "sub").mkdir()
    (source / "target" / "sub" / "extra.json").write_bytes(tokenizer)
    lock = work / "store-test.lock.json"
    lock.write_text(json.dumps(data))
    outside = work / "outside"
    outside.mkdir()
    dest = work / "dest" / "models"
    (dest / "target").mkdir(parents=True)
    (dest / "target" / "sub").symlink_to(outside, target_is_directory=True)
    return Invocation(["model", "fetch", "--recipe", str(recipe), "--dest", str(dest), "--source", "local",
                       "--source-dir", str(source), "--lock", str(lock)], may_write=[dest])


def _lock_file_case(content: bytes | None, directory: bool = False) -> Callable[[Path], Invocation]:
    def build(work: Path) -> Invocation:
        recipe, source = _store(work)
        lock = work / "store-test.lock.json"
        if directory:
            lock.mkdir()
        elif content is not None:
            lock.write_bytes(content)
        return Invocation(["lock", "check", "--recipe", str(recipe), "--lock", str(lock), "--models-dir",
                           str(source)])
    return build


def _bad_image_digest(work: Path) -> Invocation:
    recipe, _ = _store(work)
    lock = work / "store-test.lock.json"
    lock.write_text(json.dumps(_lock_data()))
    return Invocation(["lock", "check", "--recipe", str(recipe), "--lock", str(lock), "--image-digest", "sha256:xyz"])


BAD_PATHS = {
    "parent": "../escape.json",
    "parent-twice": "../../escape.json",
    "parent-inside": "sub/../../escape.json",
    "absolute": "/tmp/b70ctl-escape.json",
    "dot": "./tokenizer.json",
    "empty": "",
    "trailing-slash": "sub/",
    "double-slash": "sub//x.json",
    "backslash": "..\\escape.json",
    "newline": "a\nb.json",
    "nul": "a\x00b.json",
    "quarantine-dir": ".quarantine/target/x.json",
    "state-dir": ".b70ctl/verified-target.json",
}

LOCK_CASES = [
    *(Case(f"fetch-path-{name}", _tampered_fetch(path), 2,
           r"not a plain relative path") for name, path in BAD_PATHS.items()),
    *(Case(f"check-path-{name}", _tampered_check(path), 2, r"not a plain relative path")
      for name, path in list(BAD_PATHS.items())[:6]),
    Case("fetch-symlink-escape", _symlink_escape, 2, r"outside"),
    Case("lock-not-utf8", _lock_file_case(b'{"lock_version": 1, "recipe": "\xff\xfe"}'), 2, r"not UTF-8"),
    Case("lock-is-directory", _lock_file_case(None, directory=True), 2, r"is a directory"),
    Case("lock-missing", _lock_file_case(None), 2, r"does not exist"),
    Case("lock-not-json", _lock_file_case(b"{"), 2, r"not valid JSON"),
    Case("lock-json-list", _lock_file_case(b"[]"), 2, r"lock file .*(object|dict)"),
    Case("lock-check-bad-digest", _bad_image_digest, 2, r"--image-digest .*not a sha256 digest"),
]


@pytest.mark.parametrize("case", LOCK_CASES, ids=lambda case: case.id)
def test_locks(case: Case, tmp_path: Path) -> None:
    run_case(case, tmp_path)


@pytest.mark.parametrize("bad_name", ["../evil.json", "/abs/evil.json", ".b70ctl/evil.json"])
def test_lock_resolve_refuses_a_hub_listing_a_path_outside_the_model(bad_name, registry, tmp_path):
    """A hub (or mirror) answer naming a file outside the model: the target stays unresolved, named, exit 2;
    nothing is downloaded and nothing but the lock is written."""
    from local_endpoints import LocalHub

    hub = LocalHub()
    hub.repo(TARGET_REPO).commit({**target_files(), bad_name: b"{}"})
    hub.repo(DRAFTER_REPO).commit(drafter_files())
    hub.start()
    try:
        work = tmp_path / "case"
        work.mkdir()
        recipe = write_recipe(work)
        lock = work / "store-test.lock.json"
        before = snapshot(tmp_path)
        outcome = run_b70ctl(["lock", "resolve", "--recipe", str(recipe), "--lock", str(lock),
                              "--registry-url", registry.url], env={"HF_ENDPOINT": hub.url})
    finally:
        hub.stop()
    assert_one_line_error(outcome, 2, r"not a plain relative path")
    assert not [r for r in hub.requests if f"{TARGET_REPO}/resolve/" in r.get("path", "")]
    assert_left_clean(tmp_path, before, [lock, tmp_path / "xdg-cache", tmp_path / "hf-home"])
    assert json.loads(lock.read_text())["target"]["resolved"] is False


# --- drafter directories and model convert destinations -----------------------------------------------------


def _drafter_dirs(work: Path, drafter: dict[str, bytes] | None = None) -> tuple[Path, Path]:
    """(SRC: a drafter as SpecForge ships it, its target) under work/models/."""
    src, target = work / "models" / "drafter", work / "models" / "target"
    for directory, files in ((src, drafter if drafter is not None else drafter_files()), (target, target_files())):
        directory.mkdir(parents=True)
        for name, data in files.items():
            (directory / name).write_bytes(data)
    return src, target


def _convert(dst: Callable[[Path, Path], Path], drafter: dict[str, bytes] | None = None,
             prepare: Callable[[Path, Path], None] | None = None, may_write_dst: bool = False,
             version: str = "0.29.0") -> Callable[[Path], Invocation]:
    def build(work: Path) -> Invocation:
        src, target = _drafter_dirs(work, drafter)
        if prepare is not None:
            prepare(src, target)
        destination = dst(work, src)
        return Invocation(["model", "convert", str(src), str(destination), "--target", str(target),
                           "--vllm-version", version], may_write=[destination] if may_write_dst else [])
    return build


def _user_files_in(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "notes.txt").write_text("my notes\n")
    return directory


def _previous_conversion_of_another_source(work: Path, src: Path) -> Path:
    from b70ctl.models.convert import convert

    other = work / "other-drafter"
    other.mkdir()
    for name, data in drafter_files(seed=5).items():
        (other / name).write_bytes(data)
    dst = work / "models" / "drafter-vllm"
    convert(other, dst, "0.29.0", work / "models" / "target")
    return dst


def _previous_conversion_of_this_source(work: Path, src: Path) -> Path:
    from b70ctl.models.convert import convert

    dst = work / "models" / "drafter-vllm"
    convert(src, dst, "0.28.0", work / "models" / "target")  # another vLLM version: converted again, in place
    return dst


def _dst_link(work: Path, src: Path) -> Path:
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    link = work / "models" / "drafter-vllm"
    link.symlink_to(elsewhere, target_is_directory=True)
    return link


def _file_at(relative: str) -> Callable[[Path, Path], Path]:
    def make(work: Path, src: Path) -> Path:
        path = work / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("a file\n")
        return path
    return make


def _weights_removed(src: Path, target: Path) -> None:
    (src / "model.safetensors").unlink()


def _config_bytes(data: bytes, as_directory: bool = False) -> Callable[[Path, Path], None]:
    def prepare(src: Path, target: Path) -> None:
        (src / "config.json").unlink()
        if as_directory:
            (src / "config.json").mkdir()
        else:
            (src / "config.json").write_bytes(data)
    return prepare


def _target_config(data: bytes) -> Callable[[Path, Path], None]:
    def prepare(src: Path, target: Path) -> None:
        (target / "config.json").write_bytes(data)
    return prepare


def _config_with(**overrides: object) -> bytes:
    from store_fixtures import drafter_config

    return json.dumps(drafter_config(**overrides)).encode()


DRAFTER_CASES = [
    Case("convert-into-user-directory", _convert(lambda w, s: _user_files_in(w / "models" / "mine")), 2,
         r"not a conversion of .*: choose an empty or new directory"),
    Case("convert-into-parent-of-source", _convert(lambda w, s: w / "models"), 2,
         r"(inside|holds) the source"),
    Case("convert-into-source", _convert(lambda w, s: s), 2, r"DST must differ from SRC"),
    Case("convert-inside-source", _convert(lambda w, s: s / "vllm"), 2, r"inside the source"),
    Case("convert-onto-file", _convert(_file_at("models/drafter-vllm")), 2, r"is a file"),
    Case("convert-under-file", _convert(lambda w, s: _file_at("models/afile")(w, s) / "x"), 2, r"is a file"),
    Case("convert-onto-link", _convert(_dst_link), 2, r"symbolic link"),
    Case("convert-over-another-conversion", _convert(_previous_conversion_of_another_source), 2,
         r"conversion of another source"),
    Case("convert-over-own-conversion", _convert(_previous_conversion_of_this_source, may_write_dst=True), 0, ""),
    Case("convert-new-dir", _convert(lambda w, s: w / "models" / "drafter-vllm", may_write_dst=True), 0, ""),
    Case("convert-into-empty-dir", _convert(lambda w, s: _empty(w / "models" / "empty"), may_write_dst=True), 0, ""),
    Case("drafter-without-weights", _convert(lambda w, s: w / "models" / "x", prepare=_weights_removed), 2,
         r"no weights"),
    Case("drafter-config-not-utf8", _convert(lambda w, s: w / "models" / "x", prepare=_config_bytes(b"{\"a\": \"\xff\"}")),
         2, r"not UTF-8"),
    Case("drafter-config-directory", _convert(lambda w, s: w / "models" / "x",
                                              prepare=_config_bytes(b"", as_directory=True)), 2, r"is a directory"),
    Case("drafter-config-list", _convert(lambda w, s: w / "models" / "x", prepare=_config_bytes(b"[1]")), 2,
         r"expected a JSON object"),
    Case("drafter-config-truncated", _convert(lambda w, s: w / "models" / "x", prepare=_config_bytes(b"{\"arch")), 2,
         r"not valid JSON"),
    Case("drafter-config-missing", _convert(lambda w, s: w / "models" / "x", prepare=_config_bytes(b"")), 2,
         r"not valid JSON"),
    Case("drafter-bool-layers", _convert(lambda w, s: w / "models" / "x",
                                         prepare=_config_bytes(_config_with(num_hidden_layers=True))), 2,
         r"num_hidden_layers"),
    Case("drafter-wrong-architecture", _convert(lambda w, s: w / "models" / "x",
                                                prepare=_config_bytes(_config_with(architectures=["LlamaForCausalLM"]))),
         2, r"architectures"),
    Case("drafter-vocab-mismatch", _convert(lambda w, s: w / "models" / "x",
                                            prepare=_config_bytes(_config_with(vocab_size=999))), 2, r"vocab_size"),
    Case("target-config-not-utf8", _convert(lambda w, s: w / "models" / "x", prepare=_target_config(b"\xff\xfe")), 2,
         r"not UTF-8"),
    Case("convert-bad-version", _convert(lambda w, s: w / "models" / "x", version="latest"), 2, r"not a version"),
    Case("convert-old-version", _convert(lambda w, s: w / "models" / "x", version="0.21.0"), 2, r"no native DSpark"),
]


def _empty(directory: Path) -> Path:
    directory.mkdir(parents=True)
    return directory


@pytest.mark.parametrize("case", DRAFTER_CASES, ids=lambda case: case.id)
def test_drafter_dirs(case: Case, tmp_path: Path) -> None:
    run_case(case, tmp_path)
