"""group_vars/all.yml is the roles' meta/argument_specs.yml rendered by scripts/group-vars: every option of every role,
its default as YAML a site can uncomment, its description. A spec changed without running the script fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
ALL = REPO / "group_vars" / "all.yml"


def spec_options() -> dict[str, dict]:
    options: dict[str, dict] = {}
    for path in sorted((REPO / "roles").glob("*/meta/argument_specs.yml")):
        options |= yaml.safe_load(path.read_text())["argument_specs"]["main"].get("options") or {}
    return options


def test_the_file_is_what_the_specs_give() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "group-vars"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_every_option_is_listed_once_and_uncommented_it_is_its_default() -> None:
    """Uncommenting every variable line gives the YAML of each option set to its default (a template, a list, a
    quoted "off" stay what the role's defaults hold); <computed> stands for a template too long to show."""
    text = ALL.read_text()
    lines = [line.removeprefix("# ") for line in text.splitlines() if re.match(r"# [a-z][a-z0-9_]*: ", line)]
    names = [line.split(":", 1)[0] for line in lines]
    options = spec_options()
    assert sorted(names) == sorted(options) and len(names) == len(set(names))
    uncommented = yaml.safe_load("\n".join(lines))
    for name, option in options.items():
        if option.get("required"):  # no default: the play's caller sets it (a role's tasks_from, or the inventory)
            assert uncommented[name] == "<required>", name
        elif uncommented[name] == "<computed>":
            assert "{{" in option["default"], name
        else:
            assert uncommented[name] == option["default"], name
    assert "#     SECRET. Hugging Face token" in text and "#     SECRET. API key the servers require" in text


def test_a_spec_out_of_step_is_named_with_the_fix(tmp_path: Path) -> None:
    """--check on a stale file names the first differing line and the command that fixes it, exit 1."""
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    (copy / "scripts" / "group-vars").write_text((REPO / "scripts" / "group-vars").read_text())
    for path in (REPO / "roles").glob("*/meta/argument_specs.yml"):
        target = copy / path.relative_to(REPO)
        target.parent.mkdir(parents=True)
        target.write_text(path.read_text().replace("Model store directory on the host.", "Where the weights go."))
    (copy / "group_vars").mkdir()
    (copy / "group_vars" / "all.yml").write_text(ALL.read_text())
    done = subprocess.run([sys.executable, str(copy / "scripts" / "group-vars"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("group_vars/all.yml:") and "Where the weights go." in done.stderr
    assert done.stderr.rstrip().endswith("run scripts/group-vars")
