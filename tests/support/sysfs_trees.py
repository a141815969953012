"""The sysfs fixture builder (tests/fixtures/sysfs.py, kept free of b70ctl and runnable as a script) loaded for the
unit tests, and a helper that materializes one scenario per test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
BUILDER_PATH = REPO / "tests" / "fixtures" / "sysfs.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("b70_sysfs_fixtures", BUILDER_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


sysfs = _load()


def build_tree(tmp_path: Path, scenario: str) -> str:
    root = tmp_path / scenario
    sysfs.build(scenario, str(root))
    return str(root)
