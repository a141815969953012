"""One exception hierarchy (control/b70host/__init__.py, re-exported by b70ctl.errors): every error that ends a
command with one line is a B70Error in exactly one family, and every other exception class in the code is an
internal signal that never reaches the entry point. A new exception class must be placed in this table."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import b70ctl
import b70host
from b70ctl import errors

B70CTL = Path(sys.executable).parent / "b70ctl"
FAMILIES = (errors.BadInput, errors.Unreachable, errors.Refused, errors.HostFailed, errors.CheckAborted)

PLACED = {
    "b70host.topology.TopologyRefused": errors.Refused,
    "b70ctl.models.fetch.FetchFailed": errors.Refused,
    "b70ctl.tune.unit.HostCommandFailed": errors.HostFailed,
    "b70ctl.stops.Terminated": errors.CheckAborted,
    "b70ctl.checks.client.RunDeadlineExceeded": errors.CheckAborted,
    "b70ctl.verify.run_dir.OutDirBusy": errors.BadInput,
    "b70ctl.report.load.ReportUnusable": errors.BadInput,
}

# Caught where they are raised, each turned into a result (a report's error field, a disqualified candidate, a
# skipped file): they never end a command, so they are no B70Error.
INTERNAL = {
    "b70ctl.checks.client.RequestDeadlineExceeded", "b70ctl.checks.client.MalformedEvent",
    "b70ctl.checks.client.EndpointError", "b70ctl.checks.client.AnswerTooLarge",
    "b70ctl.checks.client.UnreadableEncoding", "b70ctl.checks.metrics.MetricsUnavailable",
    "b70ctl.checks.throughput.WorkloadFailed", "b70ctl.checks.smoke.SubCheckFailed",
    "b70ctl.tune.serving.CandidateFailed", "b70ctl.verify.pipeline.BaselineUnchecked", "b70ctl.lock.debs.ResolveError",
    "b70ctl.image.build.BuildFailed", "b70ctl.files.DuplicateKey", "b70host.level_zero.LevelZeroUnavailable",
    "b70ctl.checks.metrics.CountersUnusable", "b70ctl.lock.debcache._RangeIgnored",
}


def exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in b70ctl and b70host, by its dotted name."""
    found: dict[str, type[BaseException]] = {}
    for package in (b70ctl, b70host):
        for module_info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if module_info.name.endswith("__main__"):
                continue
            module = importlib.import_module(module_info.name)
            for _, value in inspect.getmembers(module, inspect.isclass):
                if issubclass(value, BaseException) and value.__module__ == module.__name__:
                    found[f"{value.__module__}.{value.__qualname__}"] = value
    for value in vars(b70host).values():
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == "b70host":
            found[f"b70host.{value.__qualname__}"] = value
    return found


def test_every_exception_class_is_placed_in_one_family_or_named_internal():
    classes = exception_classes()
    hierarchy = {"b70host.B70Error", *(f"b70host.{family.__name__}" for family in FAMILIES)}
    unplaced = set(classes) - hierarchy - set(PLACED) - INTERNAL
    assert not unplaced, f"place these in a family of b70host.B70Error, or name them internal here: {unplaced}"
    assert set(PLACED) | INTERNAL <= set(classes), "a class named here no longer exists"
    for name, family in PLACED.items():
        found = classes[name]
        assert issubclass(found, family), name
        assert sum(issubclass(found, other) for other in FAMILIES) == 1, f"{name} is in more than one family"
    for name in INTERNAL:
        assert not issubclass(classes[name], errors.B70Error), f"{name} would end a command: place it in a family"


def test_families_are_siblings_with_the_exit_codes_they_document():
    for family in FAMILIES:
        assert family.__bases__ == (errors.B70Error,), family
        assert family.exit_code == 2 and family.__doc__
    assert errors.B70Error is b70host.B70Error and errors.BadInput is b70host.BadInput  # one hierarchy, both sides
    assert PLACED and classes_exit_code("b70ctl.stops.Terminated") == 143  # as SIGTERM ends a process


def classes_exit_code(name: str) -> int:
    return exception_classes()[name].exit_code  # type: ignore[attr-defined]


@pytest.mark.parametrize(("argv", "line"), [
    # Unreachable: nothing listens on port 9 (discard) on this machine.
    (["verify", "--recipe", "cpu-tiny", "--endpoint", "http://127.0.0.1:9", "--baseline-endpoint",
      "http://127.0.0.1:9"], "unreachable"),
    # BadInput: a recipe name the catalogue does not have.
    (["verify", "--recipe", "no-such-recipe", "--endpoint", "http://127.0.0.1:9"], "no-such-recipe"),
])
def test_the_entry_point_ends_each_family_with_one_line_and_its_exit_code(argv, line, tmp_path):
    result = subprocess.run([str(B70CTL), *argv, "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [text for text in result.stderr.splitlines() if text.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and line in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out" / "report.json").exists()
