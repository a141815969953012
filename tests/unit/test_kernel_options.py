"""The kernel options the intel_gpu role writes (roles/intel_gpu/vars/main.yml), evaluated by the real Ansible:
intel_iommu= on Intel CPUs and where the vendor is not known; nothing of it on AMD, where only the Intel VT-d
driver (drivers/iommu/intel/iommu.c) would read it and none binds. The CPUs are the sysfs scenarios' /proc/cpuinfo
as facts.py reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from b70host.facts import collect_facts
from sysfs_trees import REPO, build_tree

ANSIBLE = str(Path(sys.executable).with_name("ansible"))


def kernel_options(inventory: dict, **variables: object) -> list[str]:
    extra = {"b70_gpu_inventory": inventory, "intel_gpu_intel_iommu": "off", "intel_gpu_kernel_options_extra": [],
             **variables}
    result = subprocess.run(
        [ANSIBLE, "localhost", "-c", "local", "-i", "localhost,", "-m", "ansible.builtin.debug",
         "-a", "var=intel_gpu_kernel_options", "-e", f"@{REPO / 'roles/intel_gpu/vars/main.yml'}",
         "-e", json.dumps(extra)],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
             "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"})
    assert result.returncode == 0, result.stdout + result.stderr
    # The ad-hoc callback prints `localhost | SUCCESS => {JSON}`.
    document = json.loads(result.stdout.split("=>", 1)[1])
    return list(document["intel_gpu_kernel_options"])


@pytest.mark.parametrize(("scenario", "vendor", "expected"), [
    ("b70x2-switch", "GenuineIntel", ["intel_iommu=off"]),
    ("b70x2-xeon-whitelisted", "GenuineIntel", ["intel_iommu=off"]),
    ("b70x2-amd-zen", "AuthenticAMD", []),
])
def test_intel_iommu_is_written_for_intel_cpus_only(tmp_path: Path, scenario: str, vendor: str,
                                                    expected: list[str]) -> None:
    facts = collect_facts(build_tree(tmp_path, scenario))
    assert facts["cpu"]["vendor_id"] == vendor
    assert kernel_options(facts) == expected


def test_an_unknown_vendor_keeps_the_option_and_extras_always_pass(tmp_path: Path) -> None:
    facts = collect_facts(build_tree(tmp_path, "b70x2-amd-zen"))
    assert kernel_options({**facts, "cpu": {"vendor_id": None, "family": None}}) == ["intel_iommu=off"]
    assert kernel_options(facts, intel_gpu_kernel_options_extra=["pci=realloc"]) == ["pci=realloc"]
    assert kernel_options({**facts, "cpu": {"vendor_id": "GenuineIntel"}}, intel_gpu_intel_iommu="") == []
