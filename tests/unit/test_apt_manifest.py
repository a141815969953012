"""Every package and version the roles pin, per Ubuntu series, is one its source publishes.

The expectation is tests/fixtures/apt-manifest.yaml: what the kobuk-team PPA, Intel's oneAPI repository and the
Ubuntu archive publish per series, each entry with where it was read. The roles' defaults are only what is checked.
The series are the release matrix's supported ones (control/b70ctl/host/releases.yaml).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFEST = yaml.safe_load((REPO / "tests" / "fixtures" / "apt-manifest.yaml").read_text())
SERIES = sorted(MANIFEST["series"])
# Each role's pins and the sources apt can take them from (the PPA installs beside the distribution's archive).
ROLES = {
    ("intel_gpu", "intel_gpu_packages_by_series"): ["kobuk-team-ppa", "ubuntu-archive"],
}


def role_default(role: str, variable: str) -> object:
    return yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())[variable]


def published(sources: list[str], series: str) -> set[tuple[str, str]]:
    return {(entry["name"], entry["version"]) for source in sources
            for entry in MANIFEST["sources"][source]["packages"].get(series, [])}


def test_manifest_covers_both_supported_series_and_records_each_source() -> None:
    assert MANIFEST["series"] == {"noble": {"version": "24.04"}, "resolute": {"version": "26.04"}}
    for name, source in MANIFEST["sources"].items():
        assert set(source["packages"]) == set(SERIES), name
        for series, entries in source["packages"].items():
            for entry in entries:
                assert entry["read_from"].strip() and isinstance(entry["checked"], bool), (name, series, entry)
                # A PPA build names the series it was built for.
                if name == "kobuk-team-ppa":
                    assert f"~{MANIFEST['series'][series]['version']}" in entry["version"], entry


@pytest.mark.parametrize("series", SERIES)
@pytest.mark.parametrize(("role", "variable"), list(ROLES))
def test_every_role_pin_is_published_for_the_series(role: str, variable: str, series: str) -> None:
    pins = role_default(role, variable)
    assert isinstance(pins, dict) and series in pins, f"{role} has no pins for {series}"
    available = published(ROLES[(role, variable)], series)
    missing = [f"{pin['name']}={pin['version']}" for pin in pins[series]
               if (pin["name"], pin["version"]) not in available]
    assert not missing, f"{role} pins for {series} that no source publishes: {missing}"


@pytest.mark.parametrize(("role", "variable"), list(ROLES))
def test_roles_pin_no_series_the_manifest_lacks(role: str, variable: str) -> None:
    assert sorted(role_default(role, variable)) == SERIES


def test_the_release_matrix_supports_exactly_the_manifest_series() -> None:
    from b70ctl.host.releases import load_matrix

    supported = load_matrix().supported
    assert {release.codename: {"version": release.version} for release in supported} == MANIFEST["series"]


def test_each_series_takes_its_gpu_runtime_from_where_the_matrix_says() -> None:
    """noble pins only PPA builds; resolute only archive builds (no PPA added there)."""
    from b70ctl.host.releases import load_matrix

    pins = role_default("intel_gpu", "intel_gpu_packages_by_series")
    for release in load_matrix().supported:
        available = published([release.gpu_runtime.source], release.codename)
        assert {(pin["name"], pin["version"]) for pin in pins[release.codename]} <= available, release.codename


def test_the_host_gets_only_what_its_tasks_use() -> None:
    """The P2P probe (host/level_zero.py) loads the Level Zero loader, which drives the GPU through
    libze-intel-gpu1; replication_check reads that package's version. Nothing else is pinned."""
    pins = role_default("intel_gpu", "intel_gpu_packages_by_series")
    for series in SERIES:
        assert sorted(pin["name"] for pin in pins[series]) == ["libze-intel-gpu1", "libze1"], series
    assert not (REPO / "roles" / "oneapi").exists()


def test_the_check_fails_on_a_package_no_source_publishes() -> None:
    """level-zero-tests: no Intel source publishes it (Intel's installers build ze_peer from source)."""
    assert ("level-zero-tests", "1.28.2-1~24.04~ppa1") not in published(
        ["kobuk-team-ppa", "ubuntu-archive", "intel-oneapi"], "noble")
    assert not any(entry["name"] == "level-zero-tests" for source in MANIFEST["sources"].values()
                   for entries in source["packages"].values() for entry in entries)
