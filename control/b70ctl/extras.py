"""Optional dependencies. `pip install b70ctl` is enough for verify and the fleet report; the controller side of the
appliance (images, models, locks, diagnose over SSH) needs the `appliance` extra. A command that needs a package
its install lacks ends with one line naming what to install (exit 2), never an ImportError's traceback."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from b70ctl.errors import BadInput

# import name -> (distribution, extra that installs it)
OPTIONAL: dict[str, tuple[str, str]] = {
    "docker": ("docker", "appliance"),
    "paramiko": ("paramiko", "appliance"),
    "huggingface_hub": ("huggingface-hub", "appliance"),
    "dockerfile_parse": ("dockerfile-parse", "appliance"),
}


def missing_extra_message(module: str, needed_for: str) -> str:
    distribution, extra = OPTIONAL[module]
    return (f"the Python package {distribution} is not installed, and {needed_for} needs it: "
            f"pip install 'b70ctl[{extra}]' (in a checkout: make venv)")


def require(module: str, needed_for: str) -> ModuleType:
    """Import an optional top-level module, or refuse in one line naming the extra that installs it."""
    if importlib.util.find_spec(module) is None:
        raise BadInput(missing_extra_message(module, needed_for))
    return importlib.import_module(module)
