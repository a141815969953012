"""The host package (control/b70host) as the roles install and run it on a host: its modules copied alone into a
b70_lib_dir (roles/b70/tasks/host_package.yml), each run through the b70 role's b70_host_python. Nothing of the
controller (b70ctl, pydantic, the repository) is on that path, so a module that reached for it fails here as it
would on a host."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "control" / "b70host"
B70_DEFAULTS = REPO / "roles" / "b70" / "defaults" / "main.yml"


@cache
def installed_lib() -> Path:
    """A directory laid out as a host's b70_lib_dir after host_package.yml: b70host/ with the package's modules."""
    lib = Path(tempfile.mkdtemp(prefix="b70-lib-"))
    atexit.register(shutil.rmtree, lib, ignore_errors=True)
    (lib / "b70host").mkdir()
    for module in PACKAGE_DIR.glob("*.py"):
        shutil.copy2(module, lib / "b70host" / module.name)
    return lib


def host_python() -> list[str]:
    """The b70 role's b70_host_python (it ends in -m), with b70_lib_dir the copy above."""
    prefix = yaml.safe_load(B70_DEFAULTS.read_text())["b70_host_python"]
    argv = [str(part).replace("{{ b70_lib_dir }}", str(installed_lib())) for part in prefix]
    assert not any("{{" in part for part in argv), f"b70_host_python templates more than b70_lib_dir: {argv}"
    return argv


def host_module(module: str, *args: str) -> list[str]:
    """The argv a role runs `b70host.<module>` with."""
    return [*host_python(), f"b70host.{module}", *args]
