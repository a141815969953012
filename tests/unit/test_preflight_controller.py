"""Preflight names a missing or unusable b70ctl on the controller (b70_ctl) with the fix, instead of letting the
recipe look-up's failure blame the recipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOST_VARS = ("ansible_connection=local b70_recipe=cpu-tiny b70_gpus=0 b70_service_user=b70 "
             "b70_model_store_dir=/var/lib/b70/models b70_api_key=k")


def preflight(tmp_path: Path, b70_ctl: Path) -> subprocess.CompletedProcess[str]:
    inventory = tmp_path / "hosts"
    inventory.write_text(f"[b70_hosts]\nhost-a {HOST_VARS} b70_ctl={b70_ctl}\n")
    env = {**os.environ, "HOME": str(tmp_path), "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
           "ANSIBLE_NOCOLOR": "1", "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
    return subprocess.run([str(Path(sys.executable).with_name("ansible-playbook")), "site.yml", "-i", str(inventory),
                           "--tags", "preflight"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["absent", "not-executable", "directory"])
def test_an_unusable_b70ctl_is_named_with_the_fix(case: str, tmp_path: Path) -> None:
    b70_ctl = tmp_path / "bin" / "b70ctl"
    if case == "not-executable":
        b70_ctl.parent.mkdir()
        b70_ctl.write_text("#!/bin/sh\n")
        b70_ctl.chmod(0o644)
    elif case == "directory":
        b70_ctl.mkdir(parents=True)
    done = preflight(tmp_path, b70_ctl)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    expected = "does not exist" if case == "absent" else "is not an executable file"
    assert f"host-a: b70_ctl {b70_ctl} {expected} on the controller" in output, output
    assert "set b70_ctl to the path of the b70ctl executable" in output
    assert "b70_recipe 'cpu-tiny' cannot be used" not in output
