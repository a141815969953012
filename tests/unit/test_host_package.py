"""The host package runs on a host with nothing but python3: every module imports with the standard library alone,
from the one directory the roles install it to, and the roles find it through the controller's b70ctl, never by a
path into this repository."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from host_package import PACKAGE_DIR, REPO, host_python, installed_lib

MODULES = sorted(path.stem for path in PACKAGE_DIR.glob("*.py") if path.stem != "__init__")

PROBE = """
import importlib, json, sys
before = set(sys.modules)
for name in sys.argv[1:]:
    importlib.import_module("b70host." + name)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_every_module_imports_with_the_standard_library_alone() -> None:
    """-S: not even the host's site-packages (a distribution's python3-yaml, python3-pydantic) are there to lean on;
    what the modules load is the standard library and the package itself."""
    runner = host_python()
    assert runner[-1] == "-m"
    probe = subprocess.run([*runner[:-1], "-S", "-c", PROBE, *MODULES], capture_output=True, text=True,
                           check=False, cwd="/")
    assert probe.returncode == 0, probe.stderr
    loaded = json.loads(probe.stdout)
    assert {f"b70host.{name}" for name in MODULES} <= set(loaded)
    foreign = [name for name in loaded
               if name != "b70host" and not name.startswith("b70host.")
               and name.split(".")[0].lstrip("_") not in sys.stdlib_module_names
               and name.split(".")[0] not in sys.stdlib_module_names]
    assert foreign == []


def test_the_runner_reaches_only_the_installed_copy() -> None:
    """With -P a module in the working directory cannot shadow the package, and the repository's b70ctl is not
    on the path the host's python3 gets."""
    check = ("import b70host, importlib.util, json; print(json.dumps([b70host.__file__, "
             "importlib.util.find_spec('b70ctl') is not None]))")
    ran = subprocess.run([*host_python()[:-1], "-c", check], capture_output=True, text=True, check=True,
                         cwd=REPO / "control")
    package_file, b70ctl_found = json.loads(ran.stdout)
    assert Path(package_file).parent == installed_lib() / "b70host"
    assert b70ctl_found is False


def test_the_roles_find_the_package_through_the_controllers_import() -> None:
    spec = importlib.util.spec_from_file_location(
        "b70_host_package", REPO / "roles" / "b70" / "lookup_plugins" / "b70_host_package.py")
    assert spec is not None and spec.loader is not None
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    assert plugin.LookupModule().run([]) == [str(PACKAGE_DIR.resolve())]


def test_no_role_reaches_into_the_repository_for_code() -> None:
    """Code reaches a host through the host package (or b70ctl on the controller), not `role_path/../..`."""
    reaching = [f"{path.relative_to(REPO)}:{number}"
                for path in sorted((REPO / "roles").rglob("*.yml"))
                for number, line in enumerate(path.read_text().splitlines(), 1)
                if "role_path" in line and "../" in line]
    assert reaching == []


def test_running_a_module_leaves_the_installed_package_as_it_was() -> None:
    """The stages' generations fingerprint b70_lib_dir/b70host: a module one stage runs (serve_wait, the roofline
    probe, the fact) must not add bytecode there, or the next run would see another stage's files changed."""
    before = sorted(path.relative_to(installed_lib()) for path in installed_lib().rglob("*"))
    ran = subprocess.run([*host_python(), "b70host.facts", "--root", "/nonexistent"], capture_output=True, text=True,
                         check=False, cwd="/")
    assert ran.returncode == 2  # ran, and refused the root: the package was imported
    assert sorted(path.relative_to(installed_lib()) for path in installed_lib().rglob("*")) == before
