"""Every role documents its inputs: meta/argument_specs.yml and defaults/main.yml name the same variables.

An option without a default must be marked required; a default without an option is undocumented.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROLES_DIR = Path(__file__).resolve().parents[2] / "roles"
ROLES = sorted(path.name for path in ROLES_DIR.iterdir() if (path / "tasks").is_dir())


def spec_and_defaults(role: str) -> tuple[dict[str, dict], set[str]]:
    specs = yaml.safe_load((ROLES_DIR / role / "meta" / "argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"].get("options") or {}
    defaults = yaml.safe_load((ROLES_DIR / role / "defaults" / "main.yml").read_text()) or {}
    return options, set(defaults)


def mismatches(options: dict[str, dict], defaults: set[str]) -> list[str]:
    problems = [f"default {name} is not in meta/argument_specs.yml" for name in sorted(defaults - set(options))]
    problems += [f"option {name} has no default and is not required" for name in sorted(set(options) - defaults)
                 if not options[name].get("required")]
    problems += [f"option {name} is required but has a default" for name in sorted(set(options) & defaults)
                 if options[name].get("required")]
    return problems


def test_the_host_layer_roles_exist() -> None:
    assert {"b70", "preflight", "intel_gpu", "oneapi", "container_engine", "gpu_topology", "pinned_apt"} <= set(ROLES)


@pytest.mark.parametrize("role", ROLES)
def test_argument_specs_match_defaults(role: str) -> None:
    options, defaults = spec_and_defaults(role)
    assert mismatches(options, defaults) == []
    assert all(option.get("description") for option in options.values()), "every option needs a description"


def test_the_check_catches_both_directions() -> None:
    options = {"a": {"type": "str"}, "b": {"type": "str"}, "c": {"type": "str", "required": True}}
    assert mismatches(options, {"a", "z"}) == [
        "default z is not in meta/argument_specs.yml",
        "option b has no default and is not required",
    ]
    assert mismatches(options, {"a", "b", "c"}) == ["option c is required but has a default"]
