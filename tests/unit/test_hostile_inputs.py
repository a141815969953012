"""Hostile and careless input, table-driven: each case is a row (what is set up, what b70ctl is asked, the exit
code and the words the one-line error must hold). Every row also checks that nothing was written outside the
place the command owns and that nothing half-written stayed (hostile.py)."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from b70ctl.lock.model import FilePin, ImagePin, ModelPin, PatchSeriesPin, build_lock, lock_document
from hostile import (
    GOOD_MODELS,
    GOOD_URL,
    HOSTILE_UNIT_VALUES,
    JSON,
    SECRET,
    Case,
    Invocation,
    Misbehaving,
    Outcome,
    assert_left_clean,
    assert_one_line_error,
    copy_fills_disk,
    disk_full,
    models,
    read_only,
    render_unit,
    run_b70ctl,
    run_case,
    snapshot,
)
from store_fixtures import DRAFTER_REPO, IMAGE_REFERENCE, TARGET_REPO, drafter_files, sha256, target_files, write_recipe
from systemd_words import systemd_split, systemd_verify_root


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Nothing a case does may touch the real user's cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")





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
    Case("drafter-config-not-utf8", _convert(lambda w, s: w / "models" / "x",
                                             prepare=_config_bytes(b"{\"a\": \"\xff\"}")),
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


# --- recorded greedy references (verify --reference): refused before any request ------------------------------


def _reference(content: bytes | None, directory: bool = False) -> Callable[[Path], Invocation]:
    def build(work: Path) -> Invocation:
        reference = work / "ref.json"
        if directory:
            reference.mkdir()
        elif content is not None:
            reference.write_bytes(content)
        return Invocation(["verify", "--endpoint", "http://127.0.0.1:9", "--recipe", "cpu-tiny", "--check",
                           "correctness", "--reference", str(reference), "--out", str(work / "out")],
                          may_write=[work / "out"])
    return build


REFERENCE_CASES = [
    Case("reference-not-utf8", _reference(b"\xff\xfe{}"), 2, r"reference file .*: not UTF-8 text"),
    Case("reference-directory", _reference(None, directory=True), 2, r"reference file .*: is a directory: re-record"),
    Case("reference-missing", _reference(None), 2, r"reference file .*: No such file"),
    Case("reference-truncated", _reference(b'{"schema_version": 1, "prompts": ['), 2, r"not valid JSON"),
    Case("reference-a-list", _reference(b"[]"), 2, r"expected a JSON object"),
    Case("reference-other-schema", _reference(b'{"schema_version": 99}'), 2, r"schema_version is 99"),
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda case: case.id)
def test_reference_files(case: Case, tmp_path: Path) -> None:
    run_case(case, tmp_path)


@pytest.mark.parametrize("case", DRAFTER_CASES, ids=lambda case: case.id)
def test_drafter_dirs(case: Case, tmp_path: Path) -> None:
    run_case(case, tmp_path)


# --- endpoints that misbehave, API keys, URLs ---------------------------------------------------------------





@dataclass(frozen=True)
class EndpointCase:
    id: str
    routes: dict[str, tuple[int, str, bytes]] | None  # None: nothing listens
    args: Callable[[str, Path], list[str]]  # (server url, work dir) -> extra arguments
    exit_code: int
    message: str
    key_file: bytes | None = None
    env: dict[str, str] | None = None
    secret_never_shown: str | None = None  # must not appear in stdout, stderr or any file
    key_sent: bool = False  # the key is good: it is sent, and the server's answer is what is wrong


def _verify_args(url: str, work: Path, *extra: str) -> list[str]:
    return ["verify", "--endpoint", url, "--recipe", "cpu-tiny", "--check", "smoke", "--out", str(work / "out"),
            "--timeout", "5", *extra]


def _with_key(url: str, work: Path) -> list[str]:
    return _verify_args(url, work, "--api-key-file", str(work / "key"))


def _userinfo(url: str, work: Path) -> list[str]:
    return _verify_args(url.replace("http://", "http://admin:hunter2pw@"), work)


ENDPOINT_CASES = [
    EndpointCase("key-with-lf", GOOD_MODELS, _with_key, 2, r"API key must be one line",
                 key_file=SECRET.encode() + b"\nX-Evil: 1\n", secret_never_shown=SECRET),
    EndpointCase("key-with-cr", GOOD_MODELS, _with_key, 2, r"API key must be one line",
                 key_file=SECRET.encode() + b"\rinjected", secret_never_shown=SECRET),
    EndpointCase("key-with-control", GOOD_MODELS, _with_key, 2, r"API key .*printable",
                 key_file=SECRET.encode() + b"\x01", secret_never_shown=SECRET),
    EndpointCase("key-with-space", GOOD_MODELS, _with_key, 2, r"API key .*printable",
                 key_file=SECRET.encode() + b" x", secret_never_shown=SECRET),
    EndpointCase("key-not-utf8", GOOD_MODELS, _with_key, 2, r"not UTF-8", key_file=b"\xff\xfe" + SECRET.encode()),
    EndpointCase("key-non-ascii", GOOD_MODELS, _with_key, 2, r"API key .*printable",
                 key_file=(SECRET + "é").encode(), secret_never_shown=SECRET),
    EndpointCase("key-empty", GOOD_MODELS, _with_key, 2, r"empty", key_file=b"\n"),
    EndpointCase("key-file-missing", GOOD_MODELS, _with_key, 2, r"No such file"),
    EndpointCase("key-env-with-lf", GOOD_MODELS, lambda u, w: _verify_args(u, w), 2,
                 r"B70CTL_API_KEY: the API key must be one line",
                 env={"B70CTL_API_KEY": SECRET + "\nX-Evil: 1"}, secret_never_shown=SECRET),
    EndpointCase("key-refused-401", models(b'{"error":"Unauthorized"}', 401), _with_key, 2,
                 r"refused the API key", key_file=SECRET.encode(), secret_never_shown=SECRET),
    EndpointCase("key-refused-403", models(b'{"error":"Forbidden"}', 403), _with_key, 2,
                 r"refused the API key", key_file=SECRET.encode(), secret_never_shown=SECRET),
    EndpointCase("key-missing-401", models(b'{"error":"Unauthorized"}', 401), lambda u, w: _verify_args(u, w), 2,
                 r"needs an API key"),
    EndpointCase("userinfo-refused-401", models(b'{"error":"Unauthorized"}', 401), _userinfo, 2,
                 r"refused", secret_never_shown="hunter2pw"),
    EndpointCase("userinfo-unreachable", None, _userinfo, 2, r"unreachable", secret_never_shown="hunter2pw"),
    EndpointCase("models-html", models(b"<html><body>It works!</body></html>", content_type="text/html"),
                 _verify_args, 2, r"/v1/models.*not JSON.*vLLM"),
    EndpointCase("models-json-list", models(b'[{"id": "tiny-qwen3"}]'), _verify_args, 2,
                 r"/v1/models.*not .*vLLM"),
    EndpointCase("models-entry-without-id", models(b'{"data":[{"name":"tiny-qwen3"}]}'), _verify_args, 2,
                 r"/v1/models.*id"),
    EndpointCase("models-id-not-string", models(b'{"data":[{"id":7}]}'), _verify_args, 2, r"/v1/models.*id"),
    EndpointCase("models-data-not-list", models(b'{"data":"tiny-qwen3"}'), _verify_args, 2, r"/v1/models.*data"),
    EndpointCase("models-entry-not-object", models(b'{"data":["tiny-qwen3"]}'), _verify_args, 2, r"/v1/models"),
    EndpointCase("models-empty", models(b'{"data":[]}'), _verify_args, 2, r"lists no model"),
    EndpointCase("models-truncated-json", models(b'{"data":[{"id":'), _verify_args, 2, r"/v1/models.*not JSON"),
    EndpointCase("models-http-500", models(b'{"error":"boom"}', 500), _verify_args, 2, r"HTTP 500"),
    EndpointCase("models-hang-up", models(b"", 0), _verify_args, 2, r"unreachable"),
    EndpointCase("models-other-model", models(b'{"data":[{"id":"other"}]}'), _verify_args, 2, r"not the recipe's"),
    EndpointCase("nothing-listens", None, _verify_args, 2, r"unreachable"),
    EndpointCase("url-unclosed-bracket", None, lambda u, w: _verify_args("http://[::1", w), 2, r"--endpoint .*URL"),
    EndpointCase("url-no-scheme", None, lambda u, w: _verify_args("b70-a:8000", w), 2, r"--endpoint .*http"),
    EndpointCase("url-ftp", None, lambda u, w: _verify_args("ftp://b70-a:8000", w), 2, r"--endpoint .*http"),
    EndpointCase("url-bad-port", None, lambda u, w: _verify_args("http://b70-a:99999", w), 2,
                 r"--endpoint .*(?i:port)"),
    EndpointCase("url-newline", None, lambda u, w: _verify_args("http://b70-a:8000\n/x", w), 2, r"--endpoint"),
    EndpointCase("baseline-url-bad", None, lambda u, w: _verify_args(GOOD_URL, w, "--baseline-endpoint", "http://[::1"),
                 2, r"--baseline-endpoint .*URL"),
    EndpointCase("timeout-zero", None, lambda u, w: _verify_args(GOOD_URL, w, "--timeout", "0"), 2, r"--timeout"),
    EndpointCase("timeout-negative", None, lambda u, w: _verify_args(GOOD_URL, w, "--timeout", "-3"), 2,
                 r"--timeout"),
    EndpointCase("timeout-nan", None, lambda u, w: _verify_args(GOOD_URL, w, "--timeout", "nan"), 2, r"--timeout"),
    EndpointCase("timeout-inf", None, lambda u, w: _verify_args(GOOD_URL, w, "--timeout", "inf"), 2, r"--timeout"),
    EndpointCase("unknown-check", None, lambda u, w: _verify_args(GOOD_URL, w, "--check", "speed"), 2,
                 r"unknown check"),
    # A server or proxy echoing the credentials in an error body: the error line and every file hold none of them.
    EndpointCase("models-500-echoes-authorization", models(b'{"error":"bad headers: Authorization: {AUTH}"}', 500),
                 _with_key, 2, r"HTTP 500: bad headers: Authorization: \[redacted\]", key_file=SECRET.encode(),
                 secret_never_shown=SECRET, key_sent=True),
    EndpointCase("models-500-echoes-token", models(b'{"error":{"message":"token {TOKEN} is not valid here"}}', 500),
                 _with_key, 2, r"HTTP 500: token \[redacted\] is not valid", key_file=SECRET.encode(),
                 secret_never_shown=SECRET, key_sent=True),
    EndpointCase("models-502-echoes-password", models(b"proxy: user admin, password {PASSWORD}", 502, "text/plain"),
                 _userinfo, 2, r"HTTP 502: proxy: user admin, password \[redacted\]", secret_never_shown="hunter2pw"),
    EndpointCase("models-500-echoes-hf-token", models(b'{"error":"HF_TOKEN=hf_hostileTok3n rejected"}', 500),
                 _verify_args, 2, r"HTTP 500: HF_TOKEN=\[redacted\] rejected", env={"HF_TOKEN": "hf_hostileTok3n"},
                 secret_never_shown="hf_hostileTok3n"),
    # Terminal escape sequences in a model name (retitle the terminal, clear the screen): never printed raw.
    EndpointCase("models-name-escapes", models(b'{"data":[{"id":"\\u001b]0;owned\\u0007\\u001b[2Jother"}]}'),
                 _verify_args, 2, r"serves other, not the recipe's", secret_never_shown="\x1b"),
]



@pytest.mark.parametrize("case", ENDPOINT_CASES, ids=lambda case: case.id)
def test_endpoints(case: EndpointCase, tmp_path: Path) -> None:
    import contextlib

    work = tmp_path / "case"
    work.mkdir()
    if case.key_file is not None:
        (work / "key").write_bytes(case.key_file)
        (work / "key").chmod(0o600)
    with Misbehaving(case.routes or {}) if case.routes is not None else contextlib.nullcontext() as server:
        url = server.url if server is not None else GOOD_URL
        before = snapshot(tmp_path)
        outcome = run_b70ctl(case.args(url, work), case.env)
    assert_one_line_error(outcome, case.exit_code, case.message)
    # A refused run may leave an empty --out (it was checked to be writable), never a report.
    assert_left_clean(tmp_path, before, [work / "out", tmp_path / "xdg-cache"])
    assert not (work / "out" / "report.json").exists()
    if case.secret_never_shown:
        shown = outcome.stdout + outcome.stderr + "".join(
            p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file() and p.name != "key")
        assert case.secret_never_shown not in shown
    if server is not None and case.key_file and case.exit_code == 2 and "refused" not in case.message \
            and not case.key_sent:
        assert not [a for a in server.authorizations if a and SECRET in a], "a bad key was sent"


def test_userinfo_in_endpoint_never_reaches_the_report(tmp_path):
    """http://user:pw@host is sent as basic auth; the report, report.md and raw/ name the host only."""
    from scripted_server import ScriptedServer

    with ScriptedServer() as served:
        url = served.url.replace("http://", "http://admin:hunter2pw@")
        outcome = run_b70ctl(["verify", "--endpoint", url, "--recipe", "cpu-tiny", "--model", "scripted",
                              "--check", "smoke", "--out", str(tmp_path / "out"), "--timeout", "5"])
    assert outcome.code in (0, 1), outcome.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["endpoint"] == served.url
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert "hunter2pw" not in written + outcome.stdout + outcome.stderr
    assert "admin" not in written


# --- verify --out: verify owns only what it made, and writes through no link it did not create ----------------


def _verify_into(prepare: Callable[[Path, Path], None], *extra: str) -> Callable[[Path], Invocation]:
    """verify into work/out after `prepare(work, out)`; nothing listens at the endpoint: each row is refused
    before any request, and nothing under the case's directory may change (may_write is empty)."""
    def build(work: Path) -> Invocation:
        out = work / "out"
        out.mkdir()
        prepare(work, out)
        return Invocation(["verify", "--endpoint", GOOD_URL, "--recipe", "cpu-tiny", "--check", "smoke", "--out",
                           str(out), "--timeout", "5", *extra])
    return build


def _users_raw(work: Path, out: Path) -> None:
    """`--out .` in a directory whose raw/ holds the user's own data."""
    (out / "raw").mkdir()
    (out / "raw" / "scan-0001.csv").write_text("t,v\n0,1\n")


def _users_report(name: str) -> Callable[[Path, Path], None]:
    def prepare(work: Path, out: Path) -> None:
        (out / name).write_text("my own notes\n")
    return prepare


def _link_in_out(name: str, directory: bool) -> Callable[[Path, Path], None]:
    """out/NAME is a link to a place outside out/ (a directory, or a file there)."""
    def prepare(work: Path, out: Path) -> None:
        outside = work / "outside"
        outside.mkdir()
        target = outside if directory else outside / "victim.txt"
        if not directory:
            target.write_text("not verify's\n")
        (out / name).symlink_to(target, target_is_directory=directory)
    return prepare


def _marked_out_with_users_raw(work: Path, out: Path) -> None:
    """A directory verify wrote before (its marker), in which the user put a raw/ of their own."""
    from b70ctl.verify.run_dir import RunDirectory

    (out / RunDirectory.MARKER_NAME).write_text(RunDirectory.MARKER_TEXT)
    _users_raw(work, out)


def _nothing(work: Path, out: Path) -> None:
    pass


def _key_file(content: bytes, mode: int = 0o600) -> Callable[[Path, Path], None]:
    def prepare(work: Path, out: Path) -> None:
        (work / "key").write_bytes(content)
        (work / "key").chmod(mode)
    return prepare


def _fifo_key(work: Path, out: Path) -> None:
    os.mkfifo(work / "key", 0o600)


def _directory_key(work: Path, out: Path) -> None:
    (work / "key").mkdir(mode=0o700)


def _with_key_file(prepare: Callable[[Path, Path], None], key: str | None = None) -> Callable[[Path], Invocation]:
    def build(work: Path) -> Invocation:
        invocation = _verify_into(prepare)(work)
        invocation.args += ["--api-key-file", key or str(work / "key")]
        return invocation
    return build


OUT_DIR_CASES = [
    Case("verify-out-users-raw", _verify_into(_users_raw), 2,
         r"--out \S*out: raw was not made by b70ctl verify \(no marker\), it would be deleted: move it away"),
    Case("verify-out-users-raw-in-verify-out", _verify_into(_marked_out_with_users_raw), 2,
         r"--out \S*out: raw was not made by b70ctl verify"),
    *(Case(f"verify-out-users-{name}", _verify_into(_users_report(name)), 2,
           rf"--out \S*out: {re.escape(name)} was not written by b70ctl verify .*it would be overwritten: move it away")
      for name in ("report.json", "report.md", "report.html")),
    Case("verify-out-raw-link", _verify_into(_link_in_out("raw", directory=True)), 2,
         r"--out \S*out: raw is a link verify did not create .*remove the link"),
    Case("verify-out-report-link", _verify_into(_link_in_out("report.md", directory=False)), 2,
         r"--out \S*out: report\.md is a link verify did not create"),
    Case("verify-out-lock-link", _verify_into(_link_in_out(".verify.lock", directory=False)), 2,
         r"--out \S*out: \.verify\.lock is a link verify did not create"),
    Case("verify-out-marker-link", _verify_into(_link_in_out("b70ctl-verify.marker", directory=False)), 2,
         r"--out \S*out: b70ctl-verify\.marker is not a marker verify wrote"),
    # --host goes into the reports and the fleet report's rows: one word.
    Case("verify-host-newline", _verify_into(_nothing, "--host", "b70-a\nb70-b"), 2,
         r"--host 'b70-a\\nb70-b': a host name is one word"),
    Case("verify-host-escape", _verify_into(_nothing, "--host", "\x1b]0;owned\x07b70-a"), 2,
         r"--host .*one word without spaces"),
    Case("verify-host-empty", _verify_into(_nothing, "--host", ""), 2, r"--host '': a host name is one word"),
    # API key files: read as ssh reads a private key (openssh-portable authfile.c, sshkey_perm_ok: "Permissions
    # 0%3.3o for '%s' are too open." ... "This private key will be ignored."): refused when others may read it.
    Case("verify-key-file-0644", _with_key_file(_key_file(SECRET.encode(), 0o644)), 2,
         r"--api-key-file \S*key: permissions 0644 are too open, others may read the key: chmod 600 \S*key$"),
    Case("verify-key-file-0640", _with_key_file(_key_file(SECRET.encode(), 0o640)), 2,
         r"--api-key-file \S*key: permissions 0640 are too open"),
    Case("verify-key-file-fifo", _with_key_file(_fifo_key), 2, r"--api-key-file \S*key: not a regular file"),
    Case("verify-key-file-dev-zero", _with_key_file(_nothing, "/dev/zero"), 2,
         r"--api-key-file /dev/zero: not a regular file"),
    Case("verify-key-file-directory", _with_key_file(_directory_key), 2, r"--api-key-file \S*key: not a regular file"),
    Case("verify-key-file-huge", _with_key_file(_key_file(b"k" * (1 << 20))), 2,
         r"--api-key-file \S*key: larger than 64 KiB, not a key"),
]


@pytest.mark.parametrize("case", OUT_DIR_CASES, ids=lambda case: case.id)
def test_verify_out_directory(case: Case, tmp_path: Path) -> None:
    outcome = run_case(case, tmp_path)
    assert SECRET not in outcome.stdout + outcome.stderr
    assert "\x1b" not in outcome.stdout + outcome.stderr


def _echoing_server_routes() -> dict[str, tuple[int, str, bytes]]:
    """vLLM's model list, and every generation answered HTTP 500 with a body that quotes the request's
    Authorization header and the bearer token, and puts escape sequences in it, as a misconfigured proxy can."""
    echo = (500, JSON, b'{"error":{"message":"upstream rejected headers {Authorization: {AUTH}} token={TOKEN} '
                       b'\\u001b]0;owned\\u0007\\u001b[2J"}}')
    return {**GOOD_MODELS, "/v1/completions": echo, "/v1/chat/completions": echo,
            "/metrics": (200, "text/plain", b"# no vLLM metrics\n")}


def _everything_written(root: Path, outcome: Outcome) -> str:
    return outcome.stdout + outcome.stderr + "".join(
        p.read_text(errors="replace") for p in root.rglob("*") if p.is_file() and p.name != "key")


def test_a_key_echoed_in_error_bodies_reaches_no_report_and_no_fleet_report(tmp_path):
    """A full run against a server that echoes the key in every error: report.json, report.md, report.html and
    raw/ hold [redacted] where the key was, and so does the fleet report made from them."""
    work = tmp_path / "case"
    (work / "reports" / "b70-a").mkdir(parents=True)
    (work / "key").write_text(SECRET + "\n")
    (work / "key").chmod(0o600)
    out = work / "reports" / "b70-a"
    with Misbehaving(_echoing_server_routes()) as server:
        outcome = run_b70ctl(["verify", "--endpoint", server.url, "--recipe", "cpu-tiny", "--check", "smoke",
                              "--out", str(out), "--timeout", "5", "--api-key-file", str(work / "key"), "--json"])
    assert outcome.code == 1, outcome.stderr  # smoke failed, and said so in the report
    assert f"Bearer {SECRET}" in server.authorizations  # the key was sent, so the server could echo it
    report = (out / "report.json").read_text()
    assert "[redacted]" in report  # the echo reached the report: redacted, not dropped
    fleet = run_b70ctl(["fleet", "report", str(work / "reports"), "--out", str(work / "fleet")])
    assert fleet.code in (0, 1), fleet.stderr
    assert (work / "fleet" / "fleet.json").exists()
    written = _everything_written(tmp_path, outcome) + fleet.stdout + fleet.stderr
    assert SECRET not in written
    assert "\x1b" not in (out / "report.md").read_text() + (out / "report.html").read_text()


def test_the_fleet_report_redacts_credentials_an_older_report_holds(tmp_path):
    """A report written elsewhere (an older verify, another controller) may hold an echoed Authorization header
    or a URL's password: the fleet process cannot know the key, so what reads as a credential is redacted."""
    from fleet_factory import make_report, write_host

    report = make_report("cpu-tiny", "b70-a")
    report.endpoint = "http://admin:hunter2pw@b70-a:8000"
    report.environment.vllm_version = f"0.32.0 (Authorization: Bearer {SECRET}) \x1b]0;owned\x07"
    write_host(tmp_path / "reports", "b70-a", report)
    write_host(tmp_path / "reports", "b70-b", unreachable={"status": "unreachable",
                                                            "reason": f"401 for Authorization: Bearer {SECRET}"})
    outcome = run_b70ctl(["fleet", "report", str(tmp_path / "reports"), "--out", str(tmp_path / "fleet")])
    assert outcome.code in (0, 1), outcome.stderr
    fleet = "".join((tmp_path / "fleet" / name).read_text() for name in ("fleet.json", "fleet.md", "fleet.html"))
    assert "[redacted]" in fleet
    assert SECRET not in fleet + outcome.stdout + outcome.stderr
    assert "hunter2pw" not in fleet
    assert "\x1b" not in fleet
    # A second run over the same reports leaves the files as they are (the redacted text compares equal).
    again = run_b70ctl(["fleet", "report", str(tmp_path / "reports"), "--out", str(tmp_path / "fleet")])
    assert "fleet report unchanged" in again.stderr


# --- roles: the token never in an environment, unit files that cannot be injected ---------------------------

REPO = Path(__file__).resolve().parents[2]


def _tasks(path: Path) -> list[dict]:
    import yaml

    found: list[dict] = []

    def walk(tasks: list[dict]) -> None:
        for task in tasks or []:
            found.append(task)
            for key in ("block", "rescue", "always"):
                walk(task.get(key))
    walk(yaml.safe_load(path.read_text()))
    return found


def test_hf_token_reaches_the_fetch_only_through_a_private_file():
    tasks = _tasks(REPO / "roles/model_store/tasks/from_controller.yml")
    for task in tasks:
        assert "b70_hf_token" not in json.dumps(task.get("environment", "")), task["name"]
        assert "HF_TOKEN:" not in json.dumps(task.get("environment", "")), task["name"]
    writes = [t for t in tasks if "b70_hf_token" in json.dumps(t) and "when" not in str(t.get("name", "")).lower()
              and t.get("ansible.builtin.copy")]
    assert writes and all(t.get("no_log") is True and t["ansible.builtin.copy"]["mode"] == "0600" for t in writes)
    fetch = next(t for t in tasks if "'model', 'stage'" in json.dumps(t.get("b70ctl", "")))
    assert "HF_TOKEN_PATH" in fetch["environment"]
    block = next(t for t in yaml_load(REPO / "roles/model_store/tasks/from_controller.yml") if "block" in t)
    removal = block["always"][0]
    assert removal["ansible.builtin.file"]["state"] == "absent" and removal.get("no_log") is True


def yaml_load(path: Path) -> list[dict]:
    import yaml

    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("name", HOSTILE_UNIT_VALUES)
def test_hostile_values_in_the_unit_are_escaped(name, tmp_path):
    """The unit is rendered with a hostile value in the recipe name and in an argument; systemd-analyze verify
    accepts it, and systemd's own parser (systemd-analyze dump is not available offline, so the unit's lines are
    checked) sees one ExecStart, no injected directive, the value intact."""
    import shutil
    import subprocess

    value = HOSTILE_UNIT_VALUES[name]
    argv = ["/usr/bin/docker", "run", "--rm", "--volume", value + ":/models:ro", "image", "--model", value]
    text = render_unit("tiny" + value, argv)
    directives = [line.split("=", 1)[0] for line in text.splitlines() if line and not line.startswith(("#", "["))]
    assert directives == ["Description", "After", "Requires", "Wants", "Type", "User", "ExecStartPre", "ExecStart",
                          "ExecStop", "Restart", "RestartSec", "TimeoutStopSec", "WantedBy"], text
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert systemd_split(exec_line.removeprefix("ExecStart=")) == argv
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here")
    root = systemd_verify_root(tmp_path / "root")
    unit = root / "etc/systemd/system/vllm-b70.service"
    unit.parent.mkdir(parents=True)
    unit.write_text(text)
    verified = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", str(unit)],
                              capture_output=True, text=True, timeout=60)
    problems = [line for line in verified.stderr.splitlines()
                if (str(unit) in line and "Failed to" not in line) or "Unknown" in line or "Invalid" in line
                or "bad" in line.lower()]
    assert verified.returncode == 0 and not problems, verified.stderr


def _inventory(text: str | None) -> Callable[[Path], Path]:
    def make(work: Path) -> Path:
        path = work / "hosts"
        if text is not None:
            path.write_text(text)
        return path
    return make


# The settings cases reach preflight's host checks (b70ctl host fit judges them), which run modules on the host:
# here the controller itself, with the interpreter the tests run under.
HOST_VARS = (f"ansible_connection=local ansible_python_interpreter={sys.executable} b70_recipe=cpu-tiny b70_gpus=0 "
             "b70_service_user=b70 b70_model_store_dir=/var/lib/b70/models b70_api_key=k ")
INVENTORY_CASES = {
    "missing": (_inventory(None), r"(?i)unable to parse|could not be parsed|no inventory"),
    "malformed-ini": (_inventory("[b70_hosts\nhost-a\n"), r"(?i)unable to parse|failed to parse"),
    "malformed-yaml": (_inventory("all: [\n"), r"(?i)unable to parse|failed to parse"),
    "empty-group": (_inventory("[others]\nhost-a ansible_connection=local\n"), r"no host in group b70_hosts"),
    "misspelt-group": (_inventory("[b70-hosts]\nhost-a ansible_connection=local\n"), r"no host in group b70_hosts"),
    "user-with-quote": (_inventory("[b70_hosts]\nhost-a " + HOST_VARS.replace("b70_service_user=b70",
                                                                                "b70_service_user=\"b7'0\"") + "\n"),
                        r"b70_service_user .* holds characters"),
    "store-dir-with-newline": (_inventory("[b70_hosts]\nhost-a\n[b70_hosts:vars]\n" + "\n".join(HOST_VARS.split())
                                          .replace("b70_model_store_dir=/var/lib/b70/models",
                                                   'b70_model_store_dir="/var/lib/b70\\nExecStartPre=+/bin/sh"')
                                          + "\n"), r"b70_model_store_dir .* holds characters"),
    "recipe-with-space": (_inventory("[b70_hosts]\nhost-a " + HOST_VARS.replace("b70_recipe=cpu-tiny",
                                                                                  "b70_recipe='cpu tiny'") + "\n"),
                          r"b70_recipe .* holds characters"),
}


@pytest.mark.parametrize("name", INVENTORY_CASES)
def test_inventories_fail_preflight(name, tmp_path):
    """`--tags preflight` on a bad inventory fails naming the problem; it never ends green with no host."""
    import subprocess
    import sys

    make, pattern = INVENTORY_CASES[name]
    work = tmp_path / "case"
    work.mkdir()
    inventory = make(work)
    env = {**os.environ, "HOME": str(tmp_path), "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
           "ANSIBLE_NOCOLOR": "1", "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
    before = snapshot(work)
    done = subprocess.run([str(Path(sys.executable).with_name("ansible-playbook")), "site.yml", "-i", str(inventory),
                           "--tags", "preflight"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    import re

    assert re.search(pattern, output), output
    assert snapshot(work) == before


# --- host facts documents: what `host facts --json` and `host environment` wrote, read back --------------------
# `host fit --facts` and `host environment` (the bundle's facts) read the b70 fact; `verify --host-facts` reads
# host_facts.json (the report's environment fields); `serve render --topology` reads /etc/b70/topology.json.


def _b70_fact(work: Path) -> dict:
    """What `b70ctl host facts --json` prints on a real-shaped host with two B70."""
    from b70host.facts import collect_facts
    from sysfs_trees import build_tree

    return collect_facts(build_tree(work, "b70x2-switch"))


def _with_first_gpu(**changes: object) -> Callable[[dict], object]:
    def change(facts: dict) -> dict:
        return {**facts, "gpus": [{**facts["gpus"][0], **changes}, *facts["gpus"][1:]]}
    return change


def _facts_file(change: Callable[[dict], object] | None = None, raw: bytes | None = None,
                directory: bool = False, stdin: bool = False) -> Callable[[Path], Invocation]:
    """`host fit` of the two-B70 recipe on a facts file (or stdin) holding `change(facts)`, or raw bytes."""
    def build(work: Path) -> Invocation:
        data = (change or (lambda facts: facts))(_b70_fact(work))
        if stdin:
            return Invocation(["host", "fit", "pr620-fp8-tp2", "--facts", "-"], stdin=json.dumps(data))
        path = work / "facts.json"
        if directory:
            path.mkdir()
        else:
            path.write_bytes(raw if raw is not None else json.dumps(data).encode())
        return Invocation(["host", "fit", "pr620-fp8-tp2", "--facts", str(path)])
    return build


def _bundle(change: Callable[[dict], object]) -> Callable[[Path], Invocation]:
    """`host environment` of a bundle whose facts are `change(facts)`, as the replication_check role pipes it."""
    def build(work: Path) -> Invocation:
        bundle = {"hostname": "b70-a", "facts": change(_b70_fact(work))}
        return Invocation(["host", "environment", "--recipe", "cpu-tiny"], stdin=json.dumps(bundle))
    return build


HOST_FACTS_JSON = {"hostname": "b70-a", "kernel": "6.17.0-1009-intel", "gpu_count": 2, "gpu_model": "2x B70",
                   "p2p_profile": "p2p"}


def _verify_host_facts(content: bytes | None) -> Callable[[Path], Invocation]:
    """verify --host-facts FILE (None: FILE is a directory); the endpoint is never asked: refused before."""
    def build(work: Path) -> Invocation:
        path = work / "host_facts.json"
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content)
        return Invocation(["verify", "--endpoint", GOOD_URL, "--recipe", "cpu-tiny", "--check", "smoke", "--out",
                           str(work / "out"), "--host-facts", str(path), "--timeout", "5"], may_write=[work / "out"])
    return build


def _topology_file(change: Callable[[dict], object] | None = None, raw: bytes | None = None,
                   directory: bool = False, missing: bool = False) -> Callable[[Path], Invocation]:
    """serve render of the two-B70 recipe with --topology FILE: the host's topology.json, changed."""
    def build(work: Path) -> Invocation:
        from b70host.topology import analyse

        path = work / "topology.json"
        if missing:
            pass
        elif directory:
            path.mkdir()
        elif raw is not None:
            path.write_bytes(raw)
        else:
            document = analyse(_b70_fact(work), 2, probe="never")
            path.write_text(json.dumps((change or (lambda d: d))(document)))
        return Invocation(["serve", "render", "--recipe", "pr620-fp8-tp2", "--topology", str(path)])
    return build


FACTS = r"host facts \S*facts\.json"
HOST_FACTS_CASES = [
    # 256 GiB: at TP=2 the image's compute-runtime 26.14 pins a host-RAM mirror of both cards (host/memory.py).
    Case("fit-facts-good", _facts_file(lambda f: {**f, "ram_total_bytes": 256 * 2 ** 30}), 0, ""),
    Case("fit-facts-ram-string", _facts_file(lambda f: {**f, "ram_total_bytes": "64GB"}), 2,
         FACTS + r": ram_total_bytes: .*integer"),
    Case("fit-facts-gpus-object", _facts_file(lambda f: {**f, "gpus": {"0": f["gpus"][0]}}), 2,
         FACTS + r": gpus: .*list"),
    Case("fit-facts-gpu-entry-list", _facts_file(lambda f: {**f, "gpus": [list(f["gpus"][0])]}), 2,
         FACTS + r": gpus\.0: "),
    Case("fit-facts-vram-string", _facts_file(_with_first_gpu(vram_bytes="32GiB")), 2,
         FACTS + r": gpus\.0\.vram_bytes: .*integer"),
    Case("fit-facts-xe-bound-string", _facts_file(_with_first_gpu(xe_bound="false")), 2,
         FACTS + r": gpus\.0\.xe_bound: .*bool"),
    Case("fit-facts-nominal-vram-bool", _facts_file(_with_first_gpu(vram_gib_nominal=True)), 2,
         FACTS + r": gpus\.0\.vram_gib_nominal: "),
    Case("fit-facts-not-utf8", _facts_file(raw=b'{"gpus": [], "kernel_release": "6.8\xff"}'), 2,
         FACTS + r": not UTF-8"),
    Case("fit-facts-directory", _facts_file(directory=True), 2, FACTS + r": is a directory"),
    Case("fit-facts-truncated", _facts_file(raw=b'{"gpus": ['), 2, FACTS + r": not valid JSON"),
    Case("fit-facts-list", _facts_file(lambda f: [f]), 2, FACTS + r": .*JSON object"),
    Case("fit-facts-stdin-mistyped", _facts_file(_with_first_gpu(pci_id=0xE223), stdin=True), 2,
         r"host facts on stdin: gpus\.0\.pci_id: .*string"),
    Case("environment-facts-gpu-count-string", _bundle(lambda f: {**f, "gpu_count": "two"}), 2,
         r"host bundle on stdin is invalid .*facts.*gpu_count"),
    Case("environment-facts-kernel-number", _bundle(lambda f: {**f, "kernel_release": 6.8}), 2,
         r"host bundle on stdin is invalid .*facts.*kernel_release"),
    Case("environment-facts-by-model-list", _bundle(lambda f: {**f, "gpu_count_by_model": ["B70"]}), 2,
         r"host bundle on stdin is invalid .*facts.*gpu_count_by_model"),
    Case("environment-facts-firmware-list", _bundle(lambda f: {**f, "firmware_files": ["xe/bmg_guc_70.bin"]}), 2,
         r"host bundle on stdin is invalid .*facts.*firmware_files"),
    Case("environment-facts-ram-string", _bundle(lambda f: {**f, "ram_total_bytes": "64GB"}), 2,
         r"host bundle on stdin is invalid .*facts.*ram_total_bytes"),
    Case("environment-facts-list", _bundle(lambda f: [f]), 2, r"host bundle on stdin is invalid .*facts"),
    Case("environment-facts-empty", _bundle(lambda f: {}), 0, ""),
    Case("verify-host-facts-gpu-count-string", _verify_host_facts(json.dumps({**HOST_FACTS_JSON, "gpu_count": "two"})
                                                                  .encode()), 2,
         r"host facts \S*host_facts\.json: gpu_count: .*integer"),
    Case("verify-host-facts-kernel-list", _verify_host_facts(json.dumps({**HOST_FACTS_JSON, "kernel": ["6.8"]})
                                                             .encode()), 2,
         r"host facts \S*host_facts\.json: kernel: "),
    Case("verify-host-facts-not-utf8", _verify_host_facts(b'{"hostname": "b70-\xff"}'), 2,
         r"host facts \S*host_facts\.json: not UTF-8"),
    Case("verify-host-facts-directory", _verify_host_facts(None), 2, r"host facts \S*host_facts\.json: is a directory"),
    Case("verify-host-facts-list", _verify_host_facts(b"[]"), 2, r"host facts \S*host_facts\.json: .*JSON object"),
    Case("topology-file-not-utf8", _topology_file(raw=b'{"profile": "p2p\xff"}'), 2,
         r"topology file \S*topology\.json: not UTF-8"),
    Case("topology-file-directory", _topology_file(directory=True), 2, r"topology file \S*topology\.json: .*directory"),
    Case("topology-file-missing", _topology_file(missing=True), 2,
         r"topology file \S*topology\.json: No such file or directory: run `b70ctl host topology --write`"),
    Case("topology-file-size-string", _topology_file(lambda d: {**d, "tensor_parallel_size": "two"}), 2,
         r"topology file \S*topology\.json: tensor_parallel_size: "),
    Case("topology-file-gpus-object", _topology_file(lambda d: {**d, "gpus": {"0": d["gpus"][0]}}), 2,
         r"topology file \S*topology\.json: gpus: "),
    Case("topology-file-list", _topology_file(lambda d: [d]), 2, r"topology file \S*topology\.json: "),
]


@pytest.mark.parametrize("case", HOST_FACTS_CASES, ids=lambda case: case.id)
def test_host_facts_files(case: Case, tmp_path: Path) -> None:
    run_case(case, tmp_path)


# --- writes that fail: the destination cannot hold the document ---------------------------------------------
# A file where a directory must be, a read-only directory, a full disk: one line naming the path and why, exit 2,
# no temporary file left and the previous document (if any) untouched. A missing parent is made.


def _new_part(path: Path) -> Path:
    """The topmost directory on the way to `path` that does not exist yet: what a command making `path` makes."""
    while not path.parent.exists():
        path = path.parent
    return path


def _under_a_file(work: Path, *rest: str) -> Path:
    (work / "afile").write_text("a file, not a directory\n")
    return work.joinpath("afile", *rest)


def _topology_write(setup: Callable[[Path], None] | None = None, tensor_parallel_size: int | None = None,
                    fault: Callable[[Path], Callable] | None = None, scenario: str = "b70x2-switch",
                    writes: bool = False) -> Callable[[Path], Invocation]:
    """host topology --write on a two-B70 tree; `setup` prepares ROOT, `fault(ROOT)` is in force while it runs."""
    def build(work: Path) -> Invocation:
        from sysfs_trees import build_tree

        root = Path(build_tree(work, scenario))
        if setup is not None:
            setup(root)
        size = ["--tensor-parallel-size", str(tensor_parallel_size)] if tensor_parallel_size else []
        return Invocation(["host", "topology", "--root", str(root), "--write", "--probe", "never", *size],
                          may_write=[root / "etc"] if writes else [], fault=fault(root) if fault else None)
    return build


def _etc_is_a_file(root: Path) -> None:
    (root / "etc").write_text("a file\n")


def _b70_dir_is_a_file(root: Path) -> None:
    (root / "etc").mkdir()
    (root / "etc" / "b70").write_text("a file\n")


def _previous_topology(root: Path) -> None:
    (root / "etc" / "b70").mkdir(parents=True)
    (root / "etc" / "b70" / "topology.json").write_text('{"previous": true}\n')


def _lock_write(lock: Callable[[Path], Path], fault: Callable[[Path], Callable] | None = None,
                writes: bool = False) -> Callable[[Path], Invocation]:
    """lock resolve --offline (no hub, no registry: it pins what it can and writes the lock) to `lock(work)`."""
    def build(work: Path) -> Invocation:
        recipe = write_recipe(work)
        path = lock(work)
        return Invocation(["lock", "resolve", "--recipe", str(recipe), "--lock", str(path), "--offline"],
                          may_write=[_new_part(path)] if writes else [], fault=fault(work) if fault else None)
    return build


def _lock_directory(work: Path) -> Path:
    (work / "locks").mkdir()
    return work / "locks"


def _existing_lock(work: Path) -> Path:
    """A lock already there (of another recipe, so resolve replaces it rather than keeping its pins)."""
    path = work / "locks" / "store-test.lock.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**_lock_data(), "recipe": "another-recipe"}))
    return path


def _fetch_write(dest: Callable[[Path], Path], fault: Callable[[Path], Callable] | None = None,
                 writes: bool = False) -> Callable[[Path], Invocation]:
    """model fetch of the store recipe from a local source into `dest(work)`."""
    def build(work: Path) -> Invocation:
        recipe, source = _store(work)
        lock = work / "store-test.lock.json"
        lock.write_text(json.dumps(_lock_data()))
        target = dest(work)
        return Invocation(["model", "fetch", "--recipe", str(recipe), "--dest", str(target), "--source", "local",
                           "--source-dir", str(source), "--lock", str(lock)],
                          may_write=[_new_part(target)] if writes else [], fault=fault(work) if fault else None)
    return build


def _model_dir_is_a_file(work: Path) -> Path:
    (work / "dest").mkdir()
    (work / "dest" / "target").write_text("a file\n")
    return work / "dest"


def _fleet_write(out: Callable[[Path], Path], fault: Callable[[Path], Callable] | None = None,
                 writes: bool = False) -> Callable[[Path], Invocation]:
    """fleet report of one host that met every claim, into `out(work)`."""
    def build(work: Path) -> Invocation:
        from fleet_factory import make_report, write_host

        write_host(work / "reports", "host-a", make_report("cpu-tiny", "host-a"))
        target = out(work)
        return Invocation(["fleet", "report", str(work / "reports"), "--out", str(target)],
                          may_write=[_new_part(target)] if writes else [], fault=fault(work) if fault else None)
    return build


def _fault(fault: Callable) -> Callable[[Path], Callable]:
    return lambda where: fault


def _read_only_at(*parts: str) -> Callable[[Path], Callable]:
    return lambda where: read_only(where.joinpath(*parts))


def _file_at_path(*parts: str) -> Callable[[Path], Path]:
    def make(work: Path) -> Path:
        path = work.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("a file\n")
        return path
    return make


def _directory_at(*parts: str) -> Callable[[Path], Path]:
    def make(work: Path) -> Path:
        work.joinpath(*parts).mkdir(parents=True)
        return work.joinpath(*parts)
    return make


NOT_A_DIRECTORY = r"(is a file, not a directory|[Nn]ot a directory)"
WRITE_CASES = [
    Case("topology-parent-missing", _topology_write(writes=True), 0, ""),
    Case("topology-etc-is-a-file", _topology_write(_etc_is_a_file), 2, r"etc/b70/topology\.json.*" + NOT_A_DIRECTORY),
    Case("topology-b70-is-a-file", _topology_write(_b70_dir_is_a_file), 2,
         r"etc/b70/topology\.json.*" + NOT_A_DIRECTORY),
    Case("topology-disk-full", _topology_write(_previous_topology, fault=_fault(disk_full)), 2,
         r"etc/b70/topology\.json.*No space left"),
    Case("topology-read-only", _topology_write(_previous_topology, fault=lambda root: read_only(root / "etc" / "b70")),
         2, r"etc/b70/topology\.json.*Permission denied"),
    Case("topology-tp-above-gpu-count", _topology_write(tensor_parallel_size=4), 2,
         r"tensor-parallel size 4.* 2 usable GPU"),
    Case("topology-tp-above-bound-gpus", _topology_write(tensor_parallel_size=2, scenario="xe-unbound"), 2,
         r"tensor-parallel size 2.* 0 usable GPU"),
    Case("topology-tp-above-gpus-keeps-previous", _topology_write(_previous_topology, tensor_parallel_size=3), 2,
         r"tensor-parallel size 3.* 2 usable GPU"),
    Case("lock-parent-missing", _lock_write(lambda w: w / "new" / "dir" / "store-test.lock.json", writes=True), 0, ""),
    Case("lock-under-a-file", _lock_write(lambda w: _under_a_file(w, "store-test.lock.json")), 2,
         r"lock file \S*afile/store-test\.lock\.json: .*" + NOT_A_DIRECTORY),
    Case("lock-is-a-directory", _lock_write(_lock_directory), 2, r"lock file \S*locks: .*is a directory"),
    Case("lock-disk-full", _lock_write(_existing_lock, fault=_fault(disk_full)), 2,
         r"lock file \S*store-test\.lock\.json: .*No space left"),
    Case("lock-read-only", _lock_write(_existing_lock, fault=_read_only_at("locks")), 2,
         r"lock file \S*store-test\.lock\.json: .*Permission denied"),
    Case("fetch-parent-missing", _fetch_write(lambda w: w / "new" / "models", writes=True), 0, ""),
    Case("fetch-dest-is-a-file", _fetch_write(_file_at_path("dest")), 2, r"--dest \S*dest: .*" + NOT_A_DIRECTORY),
    Case("fetch-dest-under-a-file", _fetch_write(lambda w: _under_a_file(w, "models")), 2,
         r"--dest \S*afile/models: .*" + NOT_A_DIRECTORY),
    Case("fetch-model-dir-is-a-file", _fetch_write(_model_dir_is_a_file), 2,
         r"--dest \S*dest: .*target.*" + NOT_A_DIRECTORY),
    Case("fetch-disk-full", _fetch_write(lambda w: w / "dest", fault=_fault(disk_full), writes=True), 2,
         r"--dest \S*dest: .*No space left"),
    Case("fetch-copy-fills-disk", _fetch_write(lambda w: w / "dest", fault=_fault(copy_fills_disk), writes=True), 2,
         r"--dest \S*dest: .*No space left"),
    Case("fetch-read-only", _fetch_write(_directory_at("dest"), fault=_read_only_at("dest")), 2,
         r"--dest \S*dest: .*Permission denied"),
    Case("fleet-parent-missing", _fleet_write(lambda w: w / "new" / "fleet", writes=True), 0, ""),
    Case("fleet-out-is-a-file", _fleet_write(_file_at_path("fleet")), 2, r"--out \S*fleet: .*" + NOT_A_DIRECTORY),
    Case("fleet-out-under-a-file", _fleet_write(lambda w: _under_a_file(w, "fleet")), 2,
         r"--out \S*afile/fleet: .*" + NOT_A_DIRECTORY),
    Case("fleet-disk-full", _fleet_write(_directory_at("fleet"), fault=_fault(disk_full)), 2,
         r"--out \S*fleet: .*No space left"),
    Case("fleet-read-only", _fleet_write(_directory_at("fleet"), fault=_read_only_at("fleet")), 2,
         r"--out \S*fleet: .*Permission denied"),
]


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda case: case.id)
def test_writes(case: Case, tmp_path: Path) -> None:
    run_case(case, tmp_path)


# --- numbers in recipes and on serve render's command line -----------------------------------------------------


def _recipe_with(path: tuple[str, ...], value_yaml: str, command: str) -> Callable[[Path], Invocation]:
    """cpu-tiny with the YAML scalar `value_yaml` written at `path`, shown or rendered."""
    def build(work: Path) -> Invocation:
        import yaml

        from b70ctl.recipes import recipe_path

        data = yaml.safe_load(recipe_path("cpu-tiny").read_text())
        node = data
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = "@VALUE@"
        recipe = work / "recipe.yaml"
        recipe.write_text(yaml.safe_dump(data, sort_keys=False).replace("'@VALUE@'", value_yaml))
        args = (["recipes", "show", str(recipe)] if command == "show" else
                ["serve", "render", "--recipe", str(recipe)])
        return Invocation(args)
    return build


def _render_port(port: str) -> Callable[[Path], Invocation]:
    return lambda work: Invocation(["serve", "render", "--recipe", "cpu-tiny", "--port", port])


RECIPE_NUMBERS = {
    "tp-true": (("serve", "tensor_parallel_size"), "true"),
    "tp-string": (("serve", "tensor_parallel_size"), "'2'"),
    "k-false": (("serve", "speculative", "num_speculative_tokens"), "false"),
    "max-model-len-yes": (("serve", "max_model_len"), "yes"),
    "gpu-memory-utilization-true": (("serve", "gpu_memory_utilization"), "true"),
    "ram-gb-min-true": (("host", "ram_gb_min"), "true"),
}
NUMBER_CASES = [
    *(Case(f"recipe-{name}-{command}", _recipe_with(path, value, command), 2,
           rf"recipe file \S*recipe\.yaml: {re.escape('.'.join(path))}: .*valid (integer|number)")
      for name, (path, value) in RECIPE_NUMBERS.items() for command in ("show", "render")),
    Case("recipe-tp-two-render", _recipe_with(("serve", "tensor_parallel_size"), "2", "render"), 0, ""),
    Case("render-port-0", _render_port("0"), 2, r"--port 0: .*1 to 65535"),
    Case("render-port-70000", _render_port("70000"), 2, r"--port 70000: .*1 to 65535"),
    Case("render-port-negative", _render_port("-1"), 2, r"--port -1: .*1 to 65535"),
    Case("render-port-65535", _render_port("65535"), 0, ""),
]


@pytest.mark.parametrize("case", NUMBER_CASES, ids=lambda case: case.id)
def test_numbers(case: Case, tmp_path: Path) -> None:
    run_case(case, tmp_path)


# --- sysfs trees: a host's (or a fixture's) tree that is not what the kernel makes ----------------------------
# Each either warns by name (the facts still print) or is one line, exit 2; never a traceback and never a silent
# "0 GPUs".


GPU_A = "0000:05:00.0"  # the first B70 of the b70x2-switch tree (the second is 0000:09:00.0)


def _device_file(address: str, name: str, content: bytes | None) -> Callable[[Path], None]:
    """Replace (None: remove) one attribute file of a PCI function, behind its /sys/bus/pci/devices link."""
    def spoil(root: Path) -> None:
        path = (root / "sys/bus/pci/devices" / address).resolve() / name
        path.unlink()
        if content is not None:
            path.write_bytes(content)
    return spoil


def _dangling(address: str) -> Callable[[Path], None]:
    def spoil(root: Path) -> None:
        link = root / "sys/bus/pci/devices" / address
        target = os.readlink(link)
        link.unlink()
        link.symlink_to(target + "-removed")
    return spoil


def _looping(address: str) -> Callable[[Path], None]:
    def spoil(root: Path) -> None:
        link = root / "sys/bus/pci/devices" / address
        link.unlink()
        link.symlink_to(address)
    return spoil


def _removed(relative: str) -> Callable[[Path], None]:
    def spoil(root: Path) -> None:
        import shutil

        shutil.rmtree(root / relative)
    return spoil


def _replaced(relative: str, content: bytes) -> Callable[[Path], None]:
    def spoil(root: Path) -> None:
        (root / relative).write_bytes(content)
    return spoil


def _drm_device_loop(root: Path) -> None:
    link = root / "sys/class/drm/card0/device"
    link.unlink()
    link.symlink_to("device")


def _sysfs(spoil: Callable[[Path], None], command: str = "facts",
           scenario: str = "b70x2-switch") -> Callable[[Path], Invocation]:
    def build(work: Path) -> Invocation:
        from sysfs_trees import build_tree

        root = Path(build_tree(work, scenario))
        spoil(root)
        args = {"facts": ["host", "facts", "--root", str(root), "--json"],
                "facts-table": ["host", "facts", "--root", str(root)],
                "topology": ["host", "topology", "--root", str(root), "--probe", "never", "--json"],
                "fit": ["host", "fit", "pr620-fp8-tp2", "--root", str(root), "--json"]}[command]
        return Invocation(args)
    return build


def _empty_root(work: Path) -> Invocation:
    (work / "root").mkdir()
    return Invocation(["host", "facts", "--root", str(work / "root"), "--json"])


def _root_not_a_directory(command: str) -> Callable[[Path], Invocation]:
    def build(work: Path) -> Invocation:
        (work / "root").write_text("a file\n")
        return Invocation(["host", command, "--root", str(work / "root")])
    return build


NO_PCI = r"sys/bus/pci/devices missing: no PCI devices could be read"
SYSFS_CASES = [
    Case("root-without-sys", _empty_root, 0, "", warning=NO_PCI),
    Case("root-is-a-file", _root_not_a_directory("facts"), 2, r"--root \S*root is not a directory"),
    Case("root-is-a-file-topology", _root_not_a_directory("topology"), 2, r"--root \S*root is not a directory"),
    Case("sys-without-bus", _sysfs(_removed("sys/bus")), 0, "", warning=NO_PCI),
    Case("sys-without-bus-table", _sysfs(_removed("sys/bus"), "facts-table"), 0, "", warning=NO_PCI),
    Case("sys-without-bus-fit", _sysfs(_removed("sys/bus"), "fit"), 1, ""),
    Case("gpu-link-dangling", _sysfs(_dangling(GPU_A)), 0, "", warning=rf"{GPU_A}: dangling link"),
    Case("gpu-link-dangling-topology", _sysfs(_dangling(GPU_A), "topology"), 0, ""),
    Case("gpu-link-loop", _sysfs(_looping(GPU_A)), 0, "", warning=rf"{GPU_A}: .*symbolic links"),
    Case("gpu-vendor-garbage", _sysfs(_device_file(GPU_A, "vendor", b"0xZZZZ\n")), 0, "",
         warning=rf"{GPU_A}/vendor holds '0xZZZZ', not a hex id"),
    Case("gpu-vendor-not-utf8", _sysfs(_device_file(GPU_A, "vendor", b"\xff\xfe\n")), 0, "",
         warning=rf"{GPU_A}/vendor is not text"),
    Case("gpu-vendor-missing", _sysfs(_device_file(GPU_A, "vendor", None)), 0, "",
         warning=rf"{GPU_A}/vendor: No such file"),
    Case("gpu-class-garbage", _sysfs(_device_file(GPU_A, "class", b"display\n")), 0, "",
         warning=rf"{GPU_A}/class holds 'display', not a hex id"),
    Case("gpu-device-missing", _sysfs(_device_file(GPU_A, "device", None)), 0, "",
         warning=rf"{GPU_A}/device: No such file.*unknown"),
    Case("gpu-device-missing-topology", _sysfs(_device_file(GPU_A, "device", None), "topology"), 0, ""),
    Case("gpu-device-missing-fit", _sysfs(_device_file(GPU_A, "device", None), "fit"), 1, ""),
    Case("gpu-device-missing-table", _sysfs(_device_file(GPU_A, "device", None), "facts-table"), 0, "",
         warning=rf"{GPU_A}/device"),
    Case("gpu-numa-not-utf8", _sysfs(_device_file(GPU_A, "numa_node", b"\xff\n")), 0, ""),
    Case("drm-device-link-loop", _sysfs(_drm_device_loop), 0, ""),
    Case("meminfo-not-utf8", _sysfs(_replaced("proc/meminfo", b"MemTotal: \xff kB\n"), "fit"), 1, ""),
]


@pytest.mark.parametrize("case", SYSFS_CASES, ids=lambda case: case.id)
def test_sysfs_trees(case: Case, tmp_path: Path) -> None:
    outcome = run_case(case, tmp_path)
    # Refused: nothing printed. Otherwise what could be read still is: the facts (or the fit, the topology).
    if case.exit_code == 2:
        assert outcome.stdout == ""
    elif outcome.stdout.startswith("{"):
        assert {"gpus", "fits", "pairs"} & set(json.loads(outcome.stdout)), outcome.stdout[:200]
    else:
        assert "Intel discrete GPU(s)" in outcome.stdout, outcome.stdout[:200]


# --- the top-level guard ------------------------------------------------------------------------------------


def test_an_escaping_exception_is_one_line_naming_the_command_and_the_saved_traceback(tmp_path, monkeypatch):
    import re

    import b70ctl.recipes.cli

    def broken(name: str) -> None:
        raise RuntimeError("a defect")

    monkeypatch.setattr(b70ctl.recipes.cli, "load_recipe", broken)
    outcome = run_b70ctl(["recipes", "show", "cpu-tiny"])
    assert_one_line_error(outcome, 2, r"b70ctl recipes show failed unexpectedly \(RuntimeError\).* in .*--debug")
    saved = Path(re.search(r"traceback is in (\S+):", outcome.error_lines[0]).group(1))
    assert saved.is_relative_to(tmp_path / "xdg-cache") and "RuntimeError: a defect" in saved.read_text()
    assert saved.stat().st_mode & 0o777 == 0o600
    with pytest.raises(RuntimeError, match="a defect"):
        run_b70ctl(["recipes", "show", "cpu-tiny", "--debug"])


# --- fleet: host directories ---------------------------------------------------------------------------------


def test_an_undecodable_host_directory_is_an_input_problem_row_and_the_rest_is_reported(tmp_path):
    from fleet_factory import make_report, write_host

    reports = tmp_path / "reports"
    reports.mkdir()
    good = tmp_path / "good"
    write_host(reports, "host-a", make_report("cpu-tiny", "host-a"))
    os.mkdir(os.fsencode(reports) + b"/host-\xff")
    out = tmp_path / "fleet"
    outcome = run_b70ctl(["fleet", "report", str(reports), "--out", str(out)])
    assert outcome.code == 1 and "Traceback" not in outcome.stderr, outcome.stderr
    fleet = json.loads((out / "fleet.json").read_text())
    hosts = {entry["host"]: entry["status"] for entry in fleet["hosts"]}
    assert hosts["host-a"] != "bad_report" and hosts["host-\\xff"] == "bad_report"
    assert any("not UTF-8" in problem["reason"] for problem in fleet["problems"])
    assert not good.exists()
