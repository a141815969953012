"""The vendor patch a base image's vLLM tree carries (route a): fetched once at a pinned commit, cached by content.

llm-scaler builds its vLLM 0.21.0 XPU image from vLLM's v0.21.0 tag plus its own `vllm/patches/
vllm_for_multi_arc.patch` (vllm/docker/Dockerfile: `git clone -b v0.21.0`, `git apply`), so the tree our series
lands on is pristine 0.21.0 plus that patch. The series file names the patch (`vendor-patch REPO COMMIT PATH`);
`b70ctl lock resolve` downloads it from GitHub at that commit and pins its sha256; the patch check and the image
build read it back from the cache, verified against the lock.

GitHub is asked through raw.githubusercontent.com (the file at the commit) and, only for a branch or tag instead
of a commit, api.github.com (the commit it points at); B70CTL_GITHUB_RAW / B70CTL_GITHUB_API name mirrors.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import httpx

from b70ctl.errors import BadInput, Refused, Unreachable
from b70ctl.files import write_text_atomically

GIT_COMMIT = re.compile(r"^[0-9a-f]{40}$")
GITHUB_RAW_DEFAULT = "https://raw.githubusercontent.com"
GITHUB_API_DEFAULT = "https://api.github.com"
NETWORK_NEEDED = "raw.githubusercontent.com (and api.github.com for a branch or tag) over HTTPS"


def github_raw() -> str:
    return (os.environ.get("B70CTL_GITHUB_RAW") or GITHUB_RAW_DEFAULT).rstrip("/")


def github_api() -> str:
    return (os.environ.get("B70CTL_GITHUB_API") or GITHUB_API_DEFAULT).rstrip("/")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "b70ctl"


def cached_path(repo: str, commit: str, path: str, cache_dir: Path | None = None) -> Path:
    """Where the file of REPO at COMMIT lives in the cache (written only after a download at that commit)."""
    return (cache_dir or cache_root()) / "vendor" / repo.replace("/", "+") / commit / path


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def resolve_commit(repo: str, revision: str, timeout_s: float = 30.0) -> str:
    """The 40-hex commit a branch or tag of a GitHub repository points at now (a commit is returned as is)."""
    if GIT_COMMIT.match(revision):
        return revision
    url = f"{github_api()}/repos/{repo}/commits/{revision}"
    try:
        response = httpx.get(url, headers={"Accept": "application/vnd.github.sha"}, timeout=timeout_s,
                             follow_redirects=True)
    except httpx.HTTPError as error:
        raise Unreachable(f"GitHub API {github_api()} unreachable for {repo}@{revision} "
                       f"({error.__class__.__name__}): needs {NETWORK_NEEDED}") from error
    commit = response.text.strip()
    if response.status_code != 200 or not GIT_COMMIT.match(commit):
        raise BadInput(f"{repo}@{revision}: GitHub answered {response.status_code}, no commit: fix the series' "
                       "vendor-patch line")
    return commit


def fetch_vendor_patch(repo: str, commit: str, path: str, expected_sha256: str | None = None,
                       cache_dir: Path | None = None, timeout_s: float = 60.0) -> Path:
    """The file PATH of REPO at COMMIT: from the cache, else downloaded into it. With EXPECTED_SHA256 (the lock's
    pin) a file hashing to anything else is refused, cached or downloaded."""
    if not GIT_COMMIT.match(commit):
        raise BadInput(f"{repo}: {commit!r} is not a 40-hex commit: resolve the lock first")
    target = cached_path(repo, commit, path, cache_dir)
    if target.is_file():
        actual = _sha256(target.read_bytes())
        if expected_sha256 is None or actual == expected_sha256:
            return target
        target.unlink()  # a corrupt or foreign file: fetch again
    url = f"{github_raw()}/{repo}/{commit}/{path}"
    try:
        response = httpx.get(url, timeout=timeout_s, follow_redirects=True)
    except httpx.HTTPError as error:
        raise Unreachable(f"cannot download {url} ({error.__class__.__name__}): needs {NETWORK_NEEDED}, or pass "
                       "--vendor-patch FILE (a copy of that file)") from error
    if response.status_code != 200:
        raise BadInput(f"{url}: HTTP {response.status_code}: check the series' vendor-patch line")
    actual = _sha256(response.content)
    if expected_sha256 is not None and actual != expected_sha256:
        raise Refused(f"{url} has sha256 {actual}, the lock pins {expected_sha256}: refusing it")
    try:
        text = response.content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadInput(f"{url} is not UTF-8 text: not a patch") from error
    write_text_atomically(target, text)
    return target
