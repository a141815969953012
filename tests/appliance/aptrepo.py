"""A local apt repository standing in for the Intel graphics PPA (with the Ubuntu archive's entries beside it).

The packages carry the names and versions the sources really publish for one Ubuntu series, read from
tests/fixtures/apt-manifest.yaml (written from public sources, never from the roles' defaults), with
empty payloads built by dpkg-deb: a role asking for a package or version the manifest lacks makes apt fail
on the test host as it would on a real one. Each also gets a NEWER decoy version, so a test can tell that the
pin, not luck, chose the installed version. Layout: dists/<suite>/{Release, main/binary-amd64/Packages} and
pool/<suite>/*.deb; the hosts use it as a file:/ repository marked trusted.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DECOY_VERSION = "99.0-1"
MANIFEST = REPO_ROOT / "tests" / "fixtures" / "apt-manifest.yaml"
# The series the Debian test hosts stand in for (their inventories set intel_gpu_apt_series).
TEST_HOST_SERIES = "noble"


@dataclass(frozen=True)
class PublishedPackage:
    name: str
    version: str


@dataclass(frozen=True)
class RolePin:
    name: str
    version: str


def load_manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def manifest_digest() -> str:
    """Names the built repository: a changed manifest builds a new one instead of reusing the old."""
    return hashlib.sha256(MANIFEST.read_bytes()).hexdigest()[:12]


def published(source: str, series: str) -> list[PublishedPackage]:
    """What the manifest says SOURCE publishes for SERIES."""
    entries = load_manifest()["sources"][source]["packages"].get(series, [])
    return [PublishedPackage(entry["name"], entry["version"]) for entry in entries]


def manifest_suites(series: str = TEST_HOST_SERIES) -> dict[str, list[PublishedPackage]]:
    """The test repository's suite: the PPA, with the distribution archive's entries of the series beside it, as a
    real host sees both."""
    return {"intel-graphics": published("kobuk-team-ppa", series) + published("ubuntu-archive", series)}


def role_pins(role: str, variable: str, series: str = TEST_HOST_SERIES) -> list[RolePin]:
    """What a role asks for on SERIES (for tests that check what got installed, not for building the repository)."""
    defaults = yaml.safe_load((REPO_ROOT / "roles" / role / "defaults" / "main.yml").read_text())
    return [RolePin(p["name"], p["version"]) for p in defaults[variable].get(series, [])]


def build_deb(name: str, version: str, out_dir: Path) -> Path:
    with tempfile.TemporaryDirectory() as work:
        control = Path(work) / "DEBIAN" / "control"
        control.parent.mkdir()
        control.write_text(f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: b70 tests "
                           f"<tests@localhost>\nDescription: empty stand-in for {name} (appliance tests)\n")
        deb = out_dir / f"{name}_{version.replace(':', '%3a')}_all.deb"
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", work, str(deb)], check=True,
                       capture_output=True)
    return deb


def packages_entry(deb: Path, repo: Path) -> str:
    control = subprocess.run(["dpkg-deb", "--field", str(deb)], check=True, capture_output=True, text=True).stdout
    data = deb.read_bytes()
    return (control.rstrip("\n") + f"\nFilename: {deb.relative_to(repo)}\nSize: {len(data)}\n"
            f"SHA256: {hashlib.sha256(data).hexdigest()}\n")


def build_suite(repo: Path, suite: str, packages: list[PublishedPackage]) -> None:
    pool = repo / "pool" / suite
    pool.mkdir(parents=True)
    entries = []
    for package in packages:
        for version in (package.version, DECOY_VERSION):
            entries.append(packages_entry(build_deb(package.name, version, pool), repo))
    binary = repo / "dists" / suite / "main" / "binary-amd64"
    binary.mkdir(parents=True)
    index = "\n".join(entries).encode()
    (binary / "Packages").write_bytes(index)
    (repo / "dists" / suite / "Release").write_text(
        f"Suite: {suite}\nCodename: {suite}\nComponents: main\nArchitectures: amd64 all\n"
        f"Date: Mon, 01 Jan 2024 00:00:00 UTC\nSHA256:\n"
        f" {hashlib.sha256(index).hexdigest()} {len(index)} main/binary-amd64/Packages\n")


def build_repository(repo: Path, suites: dict[str, list[PublishedPackage]]) -> Path:
    """Build once: a repository already built here is kept as it is, so copying it into a host that has it
    changes nothing (a rebuilt .deb would differ in its timestamps). Built beside and renamed into place."""
    if repo.is_dir():
        return repo
    partial = repo.with_name(repo.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for suite, packages in suites.items():
        build_suite(partial, suite, packages)
    partial.rename(repo)
    return repo
