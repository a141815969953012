"""Every role documents its inputs: meta/argument_specs.yml and defaults/main.yml name the same variables, and each
option carries the default defaults/main.yml gives it, so `ansible-doc -t role` shows the real one (not null).

An option without a default must be marked required; a default without an option is undocumented.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROLES_DIR = Path(__file__).resolve().parents[2] / "roles"
ROLES = sorted(path.name for path in ROLES_DIR.iterdir() if (path / "tasks").is_dir())


def spec_and_defaults(role: str) -> tuple[dict[str, dict], dict[str, object]]:
    specs = yaml.safe_load((ROLES_DIR / role / "meta" / "argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"].get("options") or {}
    defaults = yaml.safe_load((ROLES_DIR / role / "defaults" / "main.yml").read_text()) or {}
    return options, defaults


def mismatches(options: dict[str, dict], defaults: dict[str, object]) -> list[str]:
    problems = [f"default {name} is not in meta/argument_specs.yml" for name in sorted(set(defaults) - set(options))]
    problems += [f"option {name} has no default and is not required" for name in sorted(set(options) - set(defaults))
                 if not options[name].get("required")]
    problems += [f"option {name} is required but has a default" for name in sorted(set(options) & set(defaults))
                 if options[name].get("required")]
    # Ansible takes the value from defaults/main.yml; the spec's copy is what ansible-doc shows, so it must agree.
    problems += [f"option {name}: meta/argument_specs.yml says default: {options[name].get('default')!r}, "
                 f"defaults/main.yml gives {defaults[name]!r}"
                 for name in sorted(set(options) & set(defaults))
                 if not options[name].get("required") and options[name].get("default") != defaults[name]]
    return problems


def test_the_host_layer_roles_exist() -> None:
    assert {"b70", "preflight", "host_kernel", "intel_gpu", "container_engine", "gpu_topology",
            "locked_debs"} <= set(ROLES)
    assert "oneapi" not in ROLES  # its SYCL runtime was used by nothing on the host


@pytest.mark.parametrize("role", ROLES)
def test_argument_specs_match_defaults(role: str) -> None:
    options, defaults = spec_and_defaults(role)
    assert mismatches(options, defaults) == []
    assert all(option.get("description") for option in options.values()), "every option needs a description"


def test_the_check_catches_both_directions() -> None:
    options = {"a": {"type": "str", "default": "x"}, "b": {"type": "str"}, "c": {"type": "str", "required": True}}
    assert mismatches(options, {"a": "x", "z": 1}) == [
        "default z is not in meta/argument_specs.yml",
        "option b has no default and is not required",
    ]
    assert mismatches(options, {"a": "x", "b": None, "c": 3}) == ["option c is required but has a default"]


def test_the_check_catches_a_documented_default_that_differs() -> None:
    options = {"a": {"type": "str", "default": "x"}, "b": {"type": "list", "elements": "str"},
               "c": {"type": "bool", "default": "false"}}
    assert mismatches(options, {"a": "y", "b": ["main"], "c": False}) == [
        "option a: meta/argument_specs.yml says default: 'x', defaults/main.yml gives 'y'",
        "option b: meta/argument_specs.yml says default: None, defaults/main.yml gives ['main']",
        "option c: meta/argument_specs.yml says default: 'false', defaults/main.yml gives False",
    ]
