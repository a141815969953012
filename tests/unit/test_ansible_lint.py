"""The playbooks and roles pass ansible-lint at the production profile, and site.yml parses with the example
inventory (both tools pinned in requirements/constraints.txt)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(argv: list[str], **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO_ROOT / "ansible.cfg"), "NO_COLOR": "1", "ANSIBLE_NOCOLOR": "1",
           **extra_env}
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_ansible_lint_production_profile_passes() -> None:
    # ansible-lint's syntax checks run without an inventory, which ansible.cfg makes an error for real runs.
    result = run([str(BIN / "ansible-lint"), "--offline", "--profile", "production", "site.yml", "playbooks", "roles"],
                 ANSIBLE_INVENTORY_UNPARSED_FAILED="False")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in result.stderr + result.stdout


def test_site_yml_parses_with_the_example_inventory() -> None:
    result = run([str(BIN / "ansible-playbook"), "--syntax-check", "-i", "inventory.example", "site.yml"])
    assert result.returncode == 0, result.stdout + result.stderr
    listing = run([str(BIN / "ansible-playbook"), "--list-tasks", "-i", "inventory.example", "site.yml"])
    assert listing.returncode == 0, listing.stdout + listing.stderr
    for role in ("preflight", "host_kernel", "intel_gpu", "container_engine", "gpu_topology"):
        assert f"{role} : " in listing.stdout
