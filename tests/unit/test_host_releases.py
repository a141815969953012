"""The Ubuntu release matrix (control/b70ctl/host/releases.yaml) and what preflight is told from it: 24.04 and
26.04 LTS pass; 25.04 and 25.10 are refused with their end-of-life dates and the upgrade; an unknown release or
another distribution is refused naming the supported ones.

The names and dates are Ubuntu's own release table, distro-info-data's ubuntu.csv
(https://salsa.debian.org/debian/distro-info-data/-/blob/main/ubuntu.csv), as the data file quotes it.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.errors import BadInput
from b70ctl.host.releases import load_matrix, read_os_release, release_verdict

REPO = Path(__file__).resolve().parents[2]
UBUNTU_CSV = "https://salsa.debian.org/debian/distro-info-data/-/blob/main/ubuntu.csv"
# The lines of ubuntu.csv the matrix rests on (version, codename, series, created, release, eol, ...).
UBUNTU_CSV_LINES = [
    "24.04 LTS,Noble Numbat,noble,2023-10-12,2024-04-25,2029-05-31,2029-05-31,2034-04-25,2036-04-29",
    "25.04,Plucky Puffin,plucky,2024-10-10,2025-04-17,2026-01-15",
    "25.10,Questing Quokka,questing,2025-04-17,2025-10-09,2026-07-09",
    "26.04 LTS,Resolute Raccoon,resolute,2025-10-09,2026-04-23,2031-05-29,2031-05-29,2036-04-23,2038-04-27",
]
TODAY = dt.date(2026, 12, 2)


def test_the_matrix_quotes_ubuntus_release_table_and_cites_it() -> None:
    matrix = load_matrix()
    assert matrix.sources["ubuntu-csv"] == UBUNTU_CSV
    for line in UBUNTU_CSV_LINES:
        version, name, codename, _, released, eol = line.split(",")[:6]
        release = matrix.find(codename)
        assert release is not None, codename
        assert (release.version, release.name, release.lts) == (version.split()[0], name, version.endswith("LTS"))
        assert (release.released.isoformat(), release.end_of_life.isoformat()) == (released, eol)
        assert "ubuntu-csv" in release.read_from
        assert line in (REPO / "control" / "b70ctl" / "host" / "releases.yaml").read_text()


def test_supported_releases_and_what_each_installs() -> None:
    matrix = load_matrix()
    assert [(release.codename, release.version) for release in matrix.supported] == [("noble", "24.04"),
                                                                                    ("resolute", "26.04")]
    noble, resolute = matrix.find("noble"), matrix.find("resolute")
    assert noble.kernel.package == "linux-generic-hwe-24.04" and noble.kernel.series == "6.17"
    assert resolute.kernel.package == "linux-generic" and resolute.kernel.series == "7.0"
    assert noble.gpu_runtime.source == "intel-omix" and resolute.gpu_runtime.source == "ubuntu-archive"
    # OMIX's pinned series (the PPA keeps only its newest build): the suite a lock can name again later.
    assert matrix.indexes["intel-omix"].suites == ["{codename}/intel-omix/0.4"]
    assert noble.firmware.package == resolute.firmware.package == "linux-firmware"


@pytest.mark.parametrize("codename", ["noble", "resolute"])
def test_a_supported_release_passes(codename: str) -> None:
    verdict = release_verdict("Ubuntu", codename, today=TODAY)
    assert verdict.supported and verdict.release is not None and "supported until" in verdict.message


@pytest.mark.parametrize(("codename", "line"), [
    ("plucky", "Ubuntu 25.04 (plucky) reached end of life on 2026-01-15"),
    ("questing", "Ubuntu 25.10 (questing) reached end of life on 2026-07-09"),
])
def test_an_end_of_life_release_is_refused_with_its_date_and_the_upgrade(codename: str, line: str) -> None:
    verdict = release_verdict("Ubuntu", codename, today=TODAY)
    assert not verdict.supported
    assert verdict.message.startswith(line)
    assert "upgrade to 26.04 LTS (do-release-upgrade)" in verdict.message


def test_a_supported_release_past_its_end_of_life_is_refused_too() -> None:
    verdict = release_verdict("Ubuntu", "noble", today=dt.date(2029, 6, 1))
    assert not verdict.supported and "reached end of life on 2029-05-31" in verdict.message


@pytest.mark.parametrize(("distribution", "codename"), [("Ubuntu", "jammy"), ("Ubuntu", "stonking"),
                                                        ("Debian", "bookworm"), ("Ubuntu", "")])
def test_an_unknown_release_is_refused_naming_the_supported_ones(distribution: str, codename: str) -> None:
    verdict = release_verdict(distribution, codename, today=TODAY)
    assert not verdict.supported
    assert verdict.message.endswith("install one of Ubuntu 24.04 LTS (noble), Ubuntu 26.04 LTS (resolute)")


def test_os_release_is_read_as_ansible_names_the_distribution() -> None:
    assert read_os_release('NAME="Ubuntu"\nID=ubuntu\nVERSION_CODENAME=noble\n') == ("Ubuntu", "noble")
    assert read_os_release("ID=debian\nVERSION_CODENAME=bookworm\n") == ("Debian", "bookworm")


def test_the_cli_exits_1_on_a_refused_release_and_reads_os_release_under_root(tmp_path: Path) -> None:
    runner = CliRunner()
    refused = runner.invoke(app, ["host", "release", "--distribution", "Ubuntu", "--codename", "plucky", "--json"])
    assert refused.exit_code == 1 and json.loads(refused.stdout)["supported"] is False
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "os-release").write_text('ID=ubuntu\nVERSION_CODENAME="resolute"\n')
    ok = runner.invoke(app, ["host", "release", "--root", str(tmp_path), "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["codename"] == "resolute"
    missing = runner.invoke(app, ["host", "release", "--root", str(tmp_path / "none")])
    assert isinstance(missing.exception, BadInput) and missing.exception.exit_code == 2
    assert "give --distribution and --codename" in str(missing.exception)


def test_the_readme_shows_the_matrix() -> None:
    readme = (REPO / "README.md").read_text()
    for release in load_matrix().releases:
        assert f"| {release.version}{' LTS' if release.lts else ''} | {release.codename} |" in readme, release.codename
        assert release.end_of_life.isoformat() in readme


def test_preflight_reads_the_matrix_through_b70ctl() -> None:
    tasks = (REPO / "roles" / "b70" / "tasks" / "host_fit.yml").read_text()
    assert "'host', 'fit', '--hosts', '-', '--releases', b70_release_matrix" in tasks
    defaults = yaml.safe_load((REPO / "roles" / "preflight" / "defaults" / "main.yml").read_text())
    assert "preflight_ubuntu_series" not in defaults  # the matrix is the one place
    shared = yaml.safe_load((REPO / "roles" / "b70" / "defaults" / "main.yml").read_text())
    assert shared["b70_test_host_distributions"] == ["Debian"]


# The test hosts' matrix (tests/fixtures/releases-testhosts.yaml) rests on Debian's release table, distro-info-data's
# debian.csv (https://salsa.debian.org/debian/distro-info-data/-/blob/main/debian.csv), this line as read from
# distro-info-data 0.58+deb12u7 (version, codename, series, created, release, eol, eol-lts, eol-elts):
DEBIAN_CSV_BOOKWORM = "12,Bookworm,bookworm,2021-08-14,2023-06-10,2026-07-11,2028-06-30,2033-06-30"
TEST_HOST_MATRIX = REPO / "tests" / "fixtures" / "releases-testhosts.yaml"


def test_the_test_hosts_matrix_quotes_debians_release_table() -> None:
    matrix = load_matrix(str(TEST_HOST_MATRIX))
    version, name, codename, _, released, _, eol_lts = DEBIAN_CSV_BOOKWORM.split(",")[:7]
    bookworm = matrix.find(codename, "Debian")
    assert bookworm is not None and matrix.find(codename, "Ubuntu") is None
    # Regular security support ended 2026-07-11; the hosts take bookworm-security, which LTS keeps to 2028-06-30.
    assert (bookworm.version, bookworm.name, bookworm.released.isoformat(), bookworm.end_of_life.isoformat()) == (
        version, name, released, eol_lts)
    assert DEBIAN_CSV_BOOKWORM in TEST_HOST_MATRIX.read_text()
    assert (bookworm.kernel.package, bookworm.firmware.package) == ("linux-image-amd64", "firmware-linux-free")


def test_another_matrix_file_stands_in_for_the_appliances_own() -> None:
    runner = CliRunner()
    args = ["host", "release", "--distribution", "Debian", "--codename", "bookworm", "--json"]
    assert runner.invoke(app, args).exit_code == 1  # the appliance provisions no Debian
    given = runner.invoke(app, [*args, "--releases", str(TEST_HOST_MATRIX)])
    assert given.exit_code == 0, given.output
    assert json.loads(given.stdout)["message"] == "Debian 12 (bookworm), supported until 2028-06-30"
    # An empty --releases is the appliance's own matrix (the roles always pass b70_release_matrix).
    assert runner.invoke(app, [*args, "--releases", ""]).exit_code == 1
    noble = runner.invoke(app, ["host", "release", "--distribution", "Ubuntu", "--codename", "noble",
                                "--releases", str(TEST_HOST_MATRIX)])
    assert noble.exit_code == 1 and "install one of Debian 12 (bookworm)" in noble.stdout


@pytest.mark.parametrize(("content", "problem"), [
    (None, "No such file or directory"),
    ("releases: [\n", "not valid YAML (line 2: expected the node content"),
    ("- releases\n", "expected a mapping, found a list"),
    ("schema_version: 1\n", "is invalid"),
    ("schema_version: 1\nschema_version: 1\n", "key 'schema_version' on line 2 is given already on line 1"),
])
def test_a_bad_matrix_file_is_one_line(tmp_path: Path, content: str | None, problem: str) -> None:
    path = tmp_path / "matrix.yaml"
    if content is not None:
        path.write_text(content)
    result = CliRunner().invoke(app, ["host", "release", "--distribution", "Ubuntu", "--codename", "noble",
                                      "--releases", str(path)])
    assert isinstance(result.exception, BadInput) and result.exception.exit_code == 2
    assert problem in str(result.exception) and "\n" not in str(result.exception)


def test_a_release_whose_packages_come_from_no_listed_index_is_refused(tmp_path: Path) -> None:
    matrix = yaml.safe_load(TEST_HOST_MATRIX.read_text())
    matrix["releases"][0]["kernel"]["source"] = "debian-backports"
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(matrix))
    with pytest.raises(BadInput, match=r"bookworm: packages come from \['debian-backports'\], which indexes does "):
        load_matrix(str(path))


def test_every_supported_release_installs_a_kernel_every_gpu_recipe_accepts() -> None:
    """The kernel plan installs the release's kernel and reboots; were its series older than a recipe's kernel_min,
    preflight would refuse the host after the reboot (as it refuses Debian 12's 6.1, tried on a test host). The
    shipped matrix and recipes must never pair so."""
    from b70ctl.recipes import load_recipe, recipe_names
    from b70ctl.versions import version_at_least

    recipes = [recipe for recipe in map(load_recipe, recipe_names()) if recipe.host.accelerator == "xpu"]
    assert recipes
    for release in load_matrix().supported:
        for recipe in recipes:
            if recipe.host.kernel_min:
                assert version_at_least(release.kernel.series, recipe.host.kernel_min), (release.codename, recipe.name)
