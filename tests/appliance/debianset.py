"""The host package lock of the Debian test hosts, resolved from the real Debian archive this machine reaches.

What each group holds is the test hosts' release matrix (tests/fixtures/releases-testhosts.yaml, the package set
`b70ctl lock resolve --host-packages` derives from a matrix): Debian carries the Level Zero loader (libze1) and
gmmlib (libigdgmm12), which stand in for the gpu_runtime group (Intel's libze-intel-gpu1 is Ubuntu's and the
PPA's only), docker.io for container_engine, and linux-image-amd64 with firmware-linux-free for kernel (installed
by host_kernel on the test host whose emulated GPUs are unbound: a container cannot boot it, but the install is
the real one). The hosts are debootstrapped from the machine's own apt sources, so the package set reads the same
indexes (URIs and suites of /etc/apt/sources.list.d/*.sources, main): nothing here is generated from the roles, and
each version, sha256 and URL is whatever Debian publishes today.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from b70ctl.host.releases import load_matrix

B70CTL = Path(sys.executable).parent / "b70ctl"
TEST_HOST_SERIES = "bookworm"
TEST_HOST_MATRIX = Path(__file__).resolve().parents[1] / "fixtures" / "releases-testhosts.yaml"


def machine_indexes(source: str, codename: str = TEST_HOST_SERIES) -> list[dict[str, object]]:
    """Every (URI, suite) of the machine's deb822 sources for this release, main only."""
    indexes: list[dict[str, object]] = []
    for sources in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in sources.read_text().split("\n\n"):
            fields = dict(line.split(":", 1) for line in stanza.splitlines()
                          if ":" in line and not line.startswith("#"))
            suites = [suite for suite in fields.get("Suites", "").split() if suite.split("-")[0] == codename]
            if "deb" not in fields.get("Types", "deb").split() or not suites:
                continue
            for uri in fields.get("URIs", "").split():
                indexes += [{"source": source, "uri": uri, "suite": suite, "components": ["main"]}
                            for suite in suites]
    if not indexes:
        raise RuntimeError(f"no deb822 apt source for {codename} in /etc/apt/sources.list.d: cannot resolve the "
                           "test hosts' packages")
    return indexes


def package_set(codename: str = TEST_HOST_SERIES) -> dict[str, object]:
    """The test matrix's package set for the release, its indexes the machine's own."""
    release = load_matrix(str(TEST_HOST_MATRIX)).package_set()["series"][codename]  # type: ignore[index]
    sources = {index["source"] for index in release["indexes"]}
    return {"series": {codename: {**release, "indexes": [index for source in sorted(sources)
                                                         for index in machine_indexes(source, codename)]}}}


def resolve_test_lock(directory: Path) -> Path:
    """The lock beside an inventory, resolved once (a directory's hosts all install the same pins)."""
    lock = directory / "host-packages.lock.json"
    if lock.is_file():
        return lock
    spec = directory / "host-packages.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    spec.write_text(yaml.safe_dump(package_set(), sort_keys=False))
    result = subprocess.run([str(B70CTL), "lock", "resolve", "--host-packages", "--package-set", str(spec),
                             "--packages-lock", str(lock)], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"b70ctl lock resolve --host-packages failed: {result.stderr.strip()[-2000:]}")
    return lock
