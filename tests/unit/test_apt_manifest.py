"""tests/fixtures/apt-manifest.yaml, what the kobuk-team PPA, Intel's oneAPI repository and the Ubuntu archive
publish per series (each entry with where it was read), is the independent record the host package lock is held
to: tests/unit/test_host_package_lock.py compares the committed lock's resolute GPU runtime with it, and noble's PPA
pins (which this machine cannot resolve) are the ones it names. The series are the release matrix's supported ones
(control/b70ctl/host/releases.yaml).
"""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFEST = yaml.safe_load((REPO / "tests" / "fixtures" / "apt-manifest.yaml").read_text())
SERIES = sorted(MANIFEST["series"])


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


def test_the_release_matrix_supports_exactly_the_manifest_series() -> None:
    from b70ctl.host.releases import load_matrix

    supported = load_matrix().supported
    assert {release.codename: {"version": release.version} for release in supported} == MANIFEST["series"]


def test_each_series_takes_its_gpu_runtime_from_where_the_matrix_says() -> None:
    """noble's two packages come from Intel's OMIX repository; resolute's are the archive's (no PPA or OMIX
    there): the lock resolves each group from the source the matrix names, so these are the versions a resolve there
    can pin."""
    from b70ctl.host.releases import load_matrix

    for release in load_matrix().supported:
        assert release.gpu_runtime is not None
        available = {name for name, _ in published([release.gpu_runtime.source], release.codename)}
        assert set(release.gpu_runtime.names) <= available, release.codename


def test_the_host_gets_only_what_its_tasks_use() -> None:
    """The P2P probe (b70host/level_zero.py) loads the Level Zero loader, which drives the GPU through
    libze-intel-gpu1; replication_check reads that package's version. Nothing else of the GPU stack is asked for."""
    from b70ctl.host.releases import load_matrix

    for release in load_matrix().supported:
        assert release.gpu_runtime is not None
        assert sorted(release.gpu_runtime.names) == ["libze-intel-gpu1", "libze1"], release.codename
    assert not (REPO / "roles" / "oneapi").exists()


def test_the_check_fails_on_a_package_no_source_publishes() -> None:
    """level-zero-tests: no Intel source publishes it (Intel's installers build ze_peer from source)."""
    assert ("level-zero-tests", "1.28.2-1~24.04~ppa1") not in published(
        ["kobuk-team-ppa", "ubuntu-archive", "intel-oneapi"], "noble")
    assert not any(entry["name"] == "level-zero-tests" for source in MANIFEST["sources"].values()
                   for entries in source["packages"].values() for entry in entries)
