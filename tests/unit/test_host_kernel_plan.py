"""The kernel plan the host_kernel role acts on, driven by emulated sysfs trees (tests/fixtures/sysfs.py): a fresh
host whose B70s the running kernel cannot drive gets the release's kernel and firmware, a converged one (the test
hosts' trees) nothing, and a Debian test host never a kernel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.host.kernel import kernel_plan
from b70ctl.host.releases import load_matrix
from b70ctl.recipes import load_recipe
from b70host.facts import collect_facts
from sysfs_trees import build_tree

RECIPE = "pr620-fp8-tp2"


def _facts(tmp_path: Path, scenario: str) -> dict:
    return collect_facts(build_tree(tmp_path, scenario))


def test_the_unbound_tree_runs_a_kernel_too_old_for_xe(tmp_path) -> None:
    facts = _facts(tmp_path, "xe-unbound")
    assert facts["kernel_release"] == "6.8.0-45-generic"
    assert facts["gpu_count"] == 2 and facts["gpu_count_xe_bound"] == 0


@pytest.mark.parametrize(("codename", "packages"), [
    ("noble", ["linux-generic-hwe-24.04", "linux-firmware"]),
    ("resolute", ["linux-generic", "linux-firmware"]),
])
def test_unbound_b70s_get_the_releases_kernel_and_firmware(tmp_path, codename, packages) -> None:
    plan = kernel_plan(load_recipe(RECIPE), _facts(tmp_path, "xe-unbound"), "Ubuntu", codename)
    assert plan.needed and plan.reboot_required
    assert plan.packages == packages
    assert plan.release == codename and plan.kernel_release == "6.8.0-45-generic"
    assert "not bound to xe under kernel 6.8.0-45-generic" in plan.reason
    assert "firmware xe/bmg_guc_70.bin, xe/bmg_huc.bin missing" in plan.reason


@pytest.mark.parametrize("scenario", ["b70x2-switch", "b70x2-root-ports"])
@pytest.mark.parametrize(("distribution", "codename"), [("Ubuntu", "noble"), ("Ubuntu", "resolute"),
                                                        ("Debian", "bookworm")])
def test_bound_gpus_need_nothing(tmp_path, scenario, distribution, codename) -> None:
    plan = kernel_plan(load_recipe(RECIPE), _facts(tmp_path, scenario), distribution, codename)
    assert not plan.needed and plan.packages == [] and not plan.reboot_required


def test_a_debian_test_host_never_gets_a_kernel(tmp_path) -> None:
    plan = kernel_plan(load_recipe(RECIPE), _facts(tmp_path, "xe-unbound"), "Debian", "bookworm")
    assert not plan.needed and plan.packages == []
    assert plan.reason.startswith("Debian bookworm is not a release the appliance provisions kernels for")


@pytest.mark.parametrize("codename", ["plucky", "questing", "jammy"])
def test_a_release_the_matrix_does_not_provision_gets_no_kernel(tmp_path, codename) -> None:
    assert not kernel_plan(load_recipe(RECIPE), _facts(tmp_path, "xe-unbound"), "Ubuntu", codename).needed


def test_cpu_recipes_and_hosts_without_the_cards_need_nothing(tmp_path) -> None:
    assert not kernel_plan(load_recipe("cpu-tiny"), _facts(tmp_path, "xe-unbound"), "Ubuntu", "noble").needed
    plan = kernel_plan(load_recipe(RECIPE), _facts(tmp_path, "no-intel-gpu"), "Ubuntu", "noble")
    assert not plan.needed and "a kernel adds no card" in plan.reason


def test_a_broken_guc_loaded_with_a_good_one_on_disk_gets_a_reboot_only(tmp_path) -> None:
    """The tree's bmg_guc_70.bin carries 70.54.0 while the driver runs 70.58.0 (firmware updated, not rebooted
    yet): no package brings anything, a reboot loads the file. tests/unit/test_firmware_blobs.py has the rest,
    on real blobs."""
    root = Path(build_tree(tmp_path, "b70x2-switch"))
    for info in root.glob("sys/kernel/debug/dri/*/gt*/uc/guc_info"):
        info.write_text(info.read_text().replace("found release version 70.54.0", "found release version 70.58.0"))
    facts = collect_facts(str(root))
    assert facts["firmware_files"]["xe/bmg_guc_70.bin"]["release_version"] == "70.54.0"
    plan = kernel_plan(load_recipe(RECIPE), facts, "Ubuntu", "noble")
    assert plan.needed and plan.reboot_required and plan.packages == []
    assert "loaded GuC 70.58.0" in plan.reason and "intel/compute-runtime #948" in plan.reason
    assert "/lib/firmware/xe/bmg_guc_70.bin carries GuC 70.54.0: a reboot loads it" in plan.reason


def test_unbound_gpus_under_the_releases_kernel_are_not_rebooted_again(tmp_path) -> None:
    """After the reboot into 6.17 a GPU still unbound is not a kernel package's to fix: no reboot loop."""
    root = Path(build_tree(tmp_path, "xe-unbound"))
    (root / "proc" / "sys" / "kernel" / "osrelease").write_text("6.17.0-8-generic\n")
    facts = collect_facts(str(root))
    facts["firmware_files"] = {name: {**entry, "present": True} for name, entry in facts["firmware_files"].items()}
    plan = kernel_plan(load_recipe(RECIPE), facts, "Ubuntu", "noble")
    assert not plan.needed and "no kernel package fixes that" in plan.reason


def test_the_cli_prints_the_plan_from_facts_on_stdin(tmp_path) -> None:
    facts = _facts(tmp_path, "xe-unbound")
    result = CliRunner().invoke(app, ["host", "kernel-plan", "--recipe", RECIPE, "--facts", "-", "--distribution",
                                      "Ubuntu", "--codename", "noble", "--json"], input=json.dumps(facts))
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert {key: plan[key] for key in ("needed", "packages", "reboot_required")} == {
        "needed": True, "packages": ["linux-generic-hwe-24.04", "linux-firmware"], "reboot_required": True}
    assert isinstance(plan["reason"], str)


TEST_HOST_MATRIX = Path(__file__).resolve().parents[1] / "fixtures" / "releases-testhosts.yaml"


def test_under_the_test_hosts_matrix_an_unbound_debian_host_gets_debians_kernel(tmp_path) -> None:
    """What the appliance test's host 4 is planned from (tests/appliance/test_host_kernel.py)."""
    matrix = load_matrix(str(TEST_HOST_MATRIX))
    plan = kernel_plan(load_recipe(RECIPE), _facts(tmp_path, "b70x2-switch-old-kernel"), "Debian", "bookworm",
                       matrix=matrix)
    assert plan.needed and plan.packages == ["linux-image-amd64", "firmware-linux-free"]
    assert "not bound to xe under kernel 5.10.0-32-amd64 (older than Debian 12 (bookworm)'s 6.1" in plan.reason
    after = kernel_plan(load_recipe(RECIPE), _facts(tmp_path, "b70x2-switch-192gb"), "Debian", "bookworm",
                        matrix=matrix)
    assert not after.needed and after.reason == ("2 GPU(s) bound to xe under kernel 6.17.0-1009-intel, firmware "
                                                 "good")
    # The appliance's own matrix provisions no Debian, whatever the tree.
    assert not kernel_plan(load_recipe(RECIPE), _facts(tmp_path, "b70x2-switch-old-kernel"), "Debian",
                           "bookworm").needed
