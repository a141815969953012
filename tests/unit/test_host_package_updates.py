"""`lock check --host-packages` keeps security updates flowing: a locked version is a floor, except for the packages a
role holds, and a newer version is told apart by where apt says it came from.

The hosts' side is real: apt-cache policy output as a System76 owner posted it (linux-generic from a PPA whose suite
is "noble") and as a Debian 12 machine printed it (one package from bookworm-security, one from a point release,
one no index carries), with the dpkg-query lines of the same machine (tests/fixtures/apt-policy/sources.yaml). The
locks pin the versions those same outputs list for the release's archive, as a resolve of that archive would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from b70ctl.lock.debcache import read_apt_policy, update_pocket
from b70ctl.lock.debs_model import HostPackageLock

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "apt-policy"
SHA = "0" * 64


def lock_file(tmp_path: Path, codename: str, archive: str, pins: dict[str, str], requested: list[str]) -> Path:
    """A lock of one group (kernel) whose pins are `pins` (name -> version) read from `archive`."""
    index = f"{archive}/dists/{codename}/main/binary-amd64/Packages.xz"
    lock = HostPackageLock.model_validate({
        "resolved_at": "2026-12-05T00:00:00Z",
        "series": {codename: {
            "codename": codename, "architecture": "amd64", "base": "minimal", "base_packages": 0,
            "indexes": [{"source": "archive", "url": index, "sha256": SHA,
                         "release_url": f"{archive}/dists/{codename}/InRelease", "release_sha256": SHA}],
            "groups": {"kernel": {"requested": requested, "resolved": True}},
            "packages": [{"name": name, "version": version, "architecture": "amd64", "sha256": SHA, "size_bytes": 1,
                          "source": "archive", "index": index, "groups": ["kernel"],
                          "url": f"{archive}/pool/main/{name[0]}/{name}/{name}_{version}_amd64.deb"}
                         for name, version in pins.items()]}}})
    path = tmp_path / "lock.json"
    path.write_text(lock.model_dump_json())
    return path


def check(lock: Path, codename: str, dpkg: str, apt_policy: str | None, *extra: str) -> tuple[int, dict]:
    args = [str(Path(sys.executable).parent / "b70ctl"), "lock", "check", "--host-packages", "--packages-lock",
            str(lock), "--series", codename, "--group", "kernel", "--host", "b70-a", "--json", *extra]
    if apt_policy is None:
        done = subprocess.run([*args, "--installed", "-"], input=dpkg, capture_output=True, text=True)
    else:
        done = subprocess.run([*args, "--host-state", "-"], input=json.dumps({"dpkg": dpkg, "apt_policy": apt_policy}),
                              capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def test_the_fixtures_say_where_they_come_from() -> None:
    sources = yaml.safe_load((FIXTURES / "sources.yaml").read_text())
    assert sorted(sources) == sorted(path.name for path in FIXTURES.glob("*.txt"))
    assert all(entry["source"] and entry["what"] for entry in sources.values())


def test_apt_policy_is_read_for_the_installed_version_only() -> None:
    origins = read_apt_policy((FIXTURES / "debian-bookworm-host.txt").read_text())
    assert origins == {
        "libarchive13": [("bookworm-security", "http://deb.debian.org/debian-security")],
        "libc6": [("bookworm", "http://deb.debian.org/debian")],
        "bash": [],  # 5.2.15-2+b8: only /var/lib/dpkg/status carries it
    }
    ppa = read_apt_policy((FIXTURES / "system76-noble-linux-generic.txt").read_text())
    assert ppa == {"linux-generic": [("noble", "https://ppa.launchpadcontent.net/system76-dev/stable/ubuntu")]}
    # The PPA's suite is the release's name, and it is still not the release's archive.
    assert update_pocket("noble", ppa["linux-generic"], {"http://archive.ubuntu.com/ubuntu"}) is None


def test_security_and_point_release_updates_are_kept_and_an_older_package_is_installed(tmp_path: Path) -> None:
    """Debian 12: the lock pins what bookworm's own suites list below the installed versions. libarchive13's newer
    build came from bookworm-security, libc6's from a point release of the archive the lock was resolved from:
    both kept, no downgrade. bash is below the lock: installed from it."""
    lock = lock_file(tmp_path, "bookworm", "http://deb.debian.org/debian",
                     {"libarchive13": "3.6.2-1+deb12u4", "libc6": "2.36-9+deb12u7", "bash": "5.2.15-2+b13"},
                     ["libarchive13", "libc6", "bash"])
    dpkg = (FIXTURES / "debian-bookworm-host.dpkg").read_text()

    # Without apt's view the newer ones are not judged: the role asks for exactly these.
    code, first = check(lock, "bookworm", dpkg, None)
    assert code == 1 and first["origin_unknown"] == ["libarchive13", "libc6"]
    assert [item["name"] for item in first["drift"]] == ["bash"] and first["drift"][0]["kind"] == "older"

    code, report = check(lock, "bookworm", dpkg, (FIXTURES / "debian-bookworm-host.txt").read_text())
    assert code == 1  # bash still differs
    assert {item["name"]: item["origin"] for item in report["updates"]} == {
        "libarchive13": "bookworm-security (http://deb.debian.org/debian-security)",
        "libc6": "bookworm (http://deb.debian.org/debian)"}
    assert report["install_paths"] == ["/var/cache/b70/debs/bash_5.2.15-2+b13_amd64.deb"]
    assert report["downgrades"] == [] and report["hold"] == [] and report["origin_unknown"] == []
    assert "2 security or stable update(s) kept: libarchive13 3.6.2-1+deb12u5 from bookworm-security" in \
        report["message"]


def test_a_kernel_from_a_ppa_above_the_lock_is_drift_named_by_its_origin_and_never_downgraded(tmp_path: Path) -> None:
    """Ubuntu 24.04 with the System76 PPA's linux-generic: newer than the lock's noble-updates build, but not from
    noble's own pockets. Reported with where it came from; the appliance does not need that exact kernel (it is a
    floor), so it neither downgrades it nor installs over it."""
    lock = lock_file(tmp_path, "noble", "http://archive.ubuntu.com/ubuntu", {"linux-generic": "6.8.0-40.40"},
                     ["linux-generic"])
    dpkg = "ii  linux-generic 6.9.3.76060903.202405300957~1719980995~24.04~fa56f73~dev amd64\n"
    code, report = check(lock, "noble", dpkg, (FIXTURES / "system76-noble-linux-generic.txt").read_text())
    assert code == 1
    (drift,) = report["drift"]
    assert drift["kind"] == "newer"
    assert drift["origin"] == "noble (https://ppa.launchpadcontent.net/system76-dev/stable/ubuntu)"
    assert report["install_paths"] == [] and report["downgrades"] == [] and report["updates"] == []
    assert report["message"] == ("b70-a: 1 package(s) differ from the lock for noble: linux-generic "
                                 "6.9.3.76060903.202405300957~1719980995~24.04~fa56f73~dev (lock: 6.8.0-40.40, from "
                                 "noble (https://ppa.launchpadcontent.net/system76-dev/stable/ubuntu))")


def test_a_held_package_is_kept_exact_and_an_old_hold_is_released(tmp_path: Path) -> None:
    """The hold list is the role's: a held package above the lock is the one downgrade (and only it gets
    --allow-downgrades); a package an earlier release held and the role no longer holds is unheld."""
    lock = lock_file(tmp_path, "bookworm", "http://deb.debian.org/debian",
                     {"libarchive13": "3.6.2-1+deb12u4", "libc6": "2.36-9+deb12u14"}, ["libarchive13", "libc6"])
    dpkg = "ii  libarchive13 3.6.2-1+deb12u5 amd64\nhi  libc6 2.36-9+deb12u14 amd64\n"
    code, report = check(lock, "bookworm", dpkg, None, "--hold", "libarchive13")
    assert code == 1
    assert report["downgrades"] == ["libarchive13"]
    assert report["install_paths"] == ["/var/cache/b70/debs/libarchive13_3.6.2-1+deb12u4_amd64.deb"]
    assert report["hold"] == ["libarchive13"] and report["unhold"] == ["libc6"]


def test_holding_a_package_the_lock_does_not_pin_is_refused_in_one_line(tmp_path: Path) -> None:
    lock = lock_file(tmp_path, "bookworm", "http://deb.debian.org/debian", {"libc6": "2.36-9+deb12u14"}, ["libc6"])
    done = subprocess.run([str(Path(sys.executable).parent / "b70ctl"), "lock", "check", "--host-packages",
                           "--packages-lock", str(lock), "--series", "bookworm", "--installed", "-", "--hold",
                           "libze-intel-gpu1"], input="ii  libc6 2.36-9+deb12u14 amd64\n", capture_output=True,
                          text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --hold libze-intel-gpu1: not a locked package of kernel on bookworm: hold only packages the lock pins"]


@pytest.mark.parametrize("state", ['{"dpkg": 1}', "[]", '{"dpkg": "", "apt": ""}'])
def test_a_host_state_that_is_not_one_is_refused_in_one_line(tmp_path: Path, state: str) -> None:
    lock = lock_file(tmp_path, "bookworm", "http://deb.debian.org/debian", {"libc6": "2.36-9+deb12u14"}, ["libc6"])
    done = subprocess.run([str(Path(sys.executable).parent / "b70ctl"), "lock", "check", "--host-packages",
                           "--packages-lock", str(lock), "--series", "bookworm", "--host-state", "-"],
                          input=state, capture_output=True, text=True)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: --host-state -: not a host package state (")
