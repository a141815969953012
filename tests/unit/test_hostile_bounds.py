"""Hostile input, second round: inputs with no end or no bound. A file read whole (a report, host facts, a topology,
a model's config.json, a log) that is far larger than any such file, a FIFO nobody writes to, /dev/zero, JSON
nested 100000 deep or holding a 5000-digit integer.

Each row runs the real `b70ctl` in its own process, under a subprocess timeout (a FIFO that is opened would block
it forever: the timeout turns that into a failed test, not a hung run) and an address-space limit (a file read
whole would need more than it): exit code, the one `error:` line naming the file and the problem (its size and
the cap, or what it is), nothing written outside the target and nothing half-written. Large files are sparse
(os.truncate): no disk is used. No assertion is on timing.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from b70ctl.diagnose.collect import MAX_LOG_BYTES
from b70ctl.files import MAX_DOCUMENT_BYTES
from b70ctl.report.load import MAX_REPORT_BYTES
from host_package import host_module
from hostile import Outcome, assert_left_clean, assert_one_line_error, snapshot

B70CTL = [sys.executable, "-c", "import sys; from b70ctl.cli import main; sys.argv[0] = 'b70ctl'; sys.exit(main())"]
# What one b70ctl process may map. Its imports take a few hundred MiB; any file of the rows below read whole
# (never less than 1 GiB of it) would not fit.
ADDRESS_SPACE_LIMIT = 1536 * 2**20
TIMEOUT_S = 120  # a guard against a blocked open, never an assertion on how long a row takes
NESTED = b"[" * 100_000 + b"]" * 100_000
HUGE_INTEGER = b'{"gpu_count": ' + b"9" * 5000 + b"}"
# An argument is at most 128 KiB (MAX_ARG_STRLEN): 20000 levels still nest far past the interpreter's ~1000.
NESTED_ARGUMENT = "[" * 20_000 + "]" * 20_000
GOOD_URL = "http://127.0.0.1:9"  # nothing listens: every row is refused before the endpoint is asked


@dataclass
class Bound:
    """A row: what is set up under the case directory (returns the arguments), exit code, the error line."""

    id: str
    build: Callable[[Path], list[str]]
    exit_code: int
    message: str
    stdin: bytes | None = None
    may_write: Callable[[Path], list[Path]] = lambda work: []
    stdout: str | None = None  # regex stdout must match


def run(args: list[str], work: Path, stdin: bytes | None = None, command: list[str] = B70CTL) -> Outcome:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))

    env = {**os.environ, "XDG_CACHE_HOME": str(work.parent / "xdg-cache"), "COLUMNS": "400"}
    done = subprocess.run([*command, *args], input=stdin if stdin is not None else b"", capture_output=True,
                          timeout=TIMEOUT_S, env=env, cwd=work, preexec_fn=limit, check=False)
    return Outcome(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))


# --- what a file can be ---------------------------------------------------------------------------------------


def sparse(size: int) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.touch()
        os.truncate(path, size)
    return make


def fifo(path: Path) -> None:
    os.mkfifo(path)


def holding(data: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data)


def dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


KINDS: dict[str, Callable[[int], Callable[[Path], None]]] = {
    "sparse": lambda cap: sparse(cap + 1),
    "fifo": lambda cap: fifo,
    "dev-zero": lambda cap: dev_zero,
    "nested": lambda cap: holding(NESTED),
    "huge-integer": lambda cap: holding(HUGE_INTEGER),
}


def refusal(kind: str, cap: int) -> str:
    return {"sparse": rf"{re.escape(_size(cap + 1))}, over the {re.escape(_size(cap))} cap",
            "fifo": r"a FIFO, not a regular file",
            "dev-zero": r"a character device, not a regular file",
            "nested": r"JSON nested too deeply",
            "huge-integer": r"a JSON number of more than \d+ digits"}[kind]


def _size(count: int) -> str:
    from b70ctl.files import size_text

    return size_text(count)


# --- the readers ----------------------------------------------------------------------------------------------


def host_facts_for_verify(make: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def build(work: Path) -> list[str]:
        make(work / "host_facts.json")
        return ["verify", "--endpoint", GOOD_URL, "--recipe", "cpu-tiny", "--check", "smoke", "--out",
                str(work / "out"), "--host-facts", str(work / "host_facts.json"), "--timeout", "5"]
    return build


def facts_for_fit(make: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def build(work: Path) -> list[str]:
        make(work / "facts.json")
        return ["host", "fit", "--recipe", "cpu-tiny", "--facts", str(work / "facts.json")]
    return build


def topology_for_render(make: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def build(work: Path) -> list[str]:
        make(work / "topology.json")
        return ["serve", "render", "--recipe", "cpu-tiny", "--topology", str(work / "topology.json")]
    return build


def topology_for_diagnose(make: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def build(work: Path) -> list[str]:
        (work / "serve.log").write_text("INFO: Started server process\n")
        make(work / "topology.json")
        return ["diagnose", "--log", str(work / "serve.log"), "--topology", str(work / "topology.json")]
    return build


def lock_for_check(make: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def build(work: Path) -> list[str]:
        make(work / "cpu-tiny.lock.json")
        return ["lock", "check", "--recipe", "cpu-tiny", "--lock", str(work / "cpu-tiny.lock.json")]
    return build


def drafter_config(make: Callable[[Path], None], role: str = "drafter") -> Callable[[Path], list[str]]:
    """model convert of store_fixtures' drafter, with the drafter's (or the target's) config.json replaced."""
    def build(work: Path) -> list[str]:
        from store_fixtures import drafter_files, target_files

        src, target = work / "models" / "drafter", work / "models" / "target"
        for directory, files in ((src, drafter_files()), (target, target_files())):
            directory.mkdir(parents=True)
            for name, data in files.items():
                (directory / name).write_bytes(data)
        config = (src if role == "drafter" else target) / "config.json"
        config.unlink()
        make(config)
        return ["model", "convert", str(src), str(work / "models" / "drafter-vllm"), "--target", str(target),
                "--vllm-version", "0.29.0"]
    return build


def log_for_diagnose(make: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def build(work: Path) -> list[str]:
        make(work / "serve.log")
        return ["diagnose", "--log", str(work / "serve.log")]
    return build


JSON_READERS = {
    "verify-host-facts": (host_facts_for_verify, r"host facts \S*host_facts\.json: ", MAX_DOCUMENT_BYTES,
                          lambda work: [work / "out"]),
    "fit-facts": (facts_for_fit, r"host facts \S*facts\.json: ", MAX_DOCUMENT_BYTES, lambda work: []),
    "render-topology": (topology_for_render, r"topology file \S*topology\.json: ", MAX_DOCUMENT_BYTES,
                        lambda work: []),
    "diagnose-topology": (topology_for_diagnose, r"topology file \S*topology\.json: ", MAX_DOCUMENT_BYTES,
                          lambda work: []),
    "lock-check": (lock_for_check, r"lock file \S*cpu-tiny\.lock\.json: ", MAX_DOCUMENT_BYTES, lambda work: []),
    "convert-drafter-config": (drafter_config, r"drafter \S*drafter/config\.json: ", MAX_DOCUMENT_BYTES,
                               lambda work: []),
    "convert-target-config": (lambda make: drafter_config(make, "target"), r"target \S*target/config\.json: ",
                              MAX_DOCUMENT_BYTES, lambda work: []),
}

BOUND_CASES = [
    *(Bound(f"{reader}-{kind}", build(KINDS[kind](cap)), 2, where + refusal(kind, cap), may_write=may_write)
      for reader, (build, where, cap, may_write) in JSON_READERS.items() for kind in KINDS),
    # A log has no bound of its own size in memory (it is read a line at a time), only a cap on what is read.
    Bound("diagnose-log-sparse", log_for_diagnose(sparse(MAX_LOG_BYTES + 1)), 2,
          rf"--log \S*serve\.log: {re.escape(_size(MAX_LOG_BYTES + 1))}, over the 1 GiB cap: save the log"),
    Bound("diagnose-log-fifo", log_for_diagnose(fifo), 2,
          r"--log \S*serve\.log: a FIFO, not a regular file: .*pipe it in"),
    Bound("diagnose-log-dev-zero", lambda work: ["diagnose", "--log", "/dev/zero"], 2,
          r"--log /dev/zero: a character device, not a regular file"),
    Bound("diagnose-log-directory", lambda work: ["diagnose", "--log", str(work)], 2,
          r"--log \S*: Is a directory: give a readable log file"),
    # JSON that breaks Python's parser in a log is a log line like any other, not a traceback.
    Bound("diagnose-log-nested-json", log_for_diagnose(holding(b"{" + NESTED)), 0, "",
          stdout=r"no known failure in 1 line\(s\)"),
    Bound("diagnose-log-huge-integer", log_for_diagnose(holding(b'{"recipe": "x", "smoke": ' + b"9" * 5000 + b"}")),
          0, "", stdout=r"no known failure in 1 line\(s\)"),
    # 512 MiB of NUL bytes, no line end: read in pieces, never whole (the address-space limit would not hold it).
    Bound("diagnose-log-one-endless-line", log_for_diagnose(sparse(512 * 2**20)), 0, "",
          stdout=r"no known failure in 1 line\(s\)"),
    Bound("fallback-topology-fifo", lambda work: (fifo(work / "topology.json"), [
        "host", "fallback", "--topology", str(work / "topology.json"), "--signature", "ze-ipc-open-invalid-argument",
        "--evidence", "x"])[1], 2, r"topology file \S*topology\.json: a FIFO, not a regular file"),
    Bound("fallback-topology-stdin-nested", lambda work: ["host", "fallback", "--topology", "-", "--signature",
                                                          "ze-ipc-open-invalid-argument", "--evidence", "x"], 2,
          r"--topology -: JSON nested too deeply", stdin=NESTED),
    Bound("fit-facts-stdin-over-cap", lambda work: ["host", "fit", "--recipe", "cpu-tiny", "--facts", "-"], 2,
          rf"host facts on stdin: more, over the {re.escape(_size(MAX_DOCUMENT_BYTES))} cap",
          stdin=b" " * (MAX_DOCUMENT_BYTES + 1)),
    Bound("environment-bundle-stdin-over-cap", lambda work: ["host", "environment", "--recipe", "cpu-tiny"], 2,
          r"host bundle on stdin: more, over the 16 MiB cap", stdin=b" " * (MAX_DOCUMENT_BYTES + 1)),
    Bound("render-tuned-nested", lambda work: ["serve", "render", "--recipe", "cpu-tiny", "--tuned", NESTED_ARGUMENT],
          2, r"--tuned: JSON nested too deeply"),
    Bound("render-tuned-huge-integer", lambda work: ["serve", "render", "--recipe", "cpu-tiny", "--tuned",
                                                     HUGE_INTEGER.decode()], 2,
          r"--tuned: a JSON number of more than \d+ digits"),
    Bound("verify-max-answer-mb-1e308", lambda work: ["verify", "--endpoint", GOOD_URL, "--recipe", "cpu-tiny",
                                                      "--out", str(work / "out"), "--max-answer-mb", "1e308"], 2,
          r"--max-answer-mb 1e\+308: give at most 1048576 MiB"),
]


@pytest.mark.parametrize("case", BOUND_CASES, ids=lambda case: case.id)
def test_bounded_reads(case: Bound, tmp_path: Path) -> None:
    work = tmp_path / "case"
    work.mkdir()
    args = case.build(work)
    before = snapshot(tmp_path)
    outcome = run(args, work, case.stdin)
    assert_one_line_error(outcome, case.exit_code, case.message)
    if case.stdout is not None:
        assert re.search(case.stdout, outcome.stdout), outcome.stdout
    assert_left_clean(tmp_path, before, case.may_write(work) + [tmp_path / "xdg-cache"])
    assert not (work / "out" / "report.json").exists()


# --- the fleet report: a host's bad file is a row of the fleet report, the other hosts are reported ------------


FLEET_FILES = {
    "report-sparse": ("report.json", sparse(MAX_REPORT_BYTES + 1),
                      rf"{re.escape(_size(MAX_REPORT_BYTES + 1))}, over the 64 MiB cap"),
    "report-fifo": ("report.json", fifo, r"a FIFO, not a regular file"),
    "report-dev-zero": ("report.json", dev_zero, r"a character device, not a regular file"),
    "report-nested": ("report.json", holding(NESTED), r"(JSON nested too deeply|recursion limit)"),
    "report-huge-integer": ("report.json", holding(b'{"schema_version": ' + b"9" * 5000 + b"}"),
                            r"(a JSON number of more than \d+ digits|number out of range)"),
    # host_facts.json and unreachable.json are read only when they are regular files (a FIFO is not looked at).
    "host-facts-sparse": ("host_facts.json", sparse(MAX_DOCUMENT_BYTES + 1),
                          r"host facts not used \(.*over the 16 MiB cap"),
    "host-facts-nested": ("host_facts.json", holding(NESTED), r"host facts not used \(JSON nested too deeply"),
    "host-facts-huge-integer": ("host_facts.json", holding(HUGE_INTEGER),
                                r"host facts not used \(a JSON number of more than \d+ digits"),
    "marker-sparse": ("unreachable.json", sparse(MAX_DOCUMENT_BYTES + 1), r"unreadable marker \(.*over the 16 MiB cap"),
}


@pytest.mark.parametrize("name", FLEET_FILES)
def test_fleet_report_names_a_hosts_unbounded_file_and_reports_the_rest(name: str, tmp_path: Path) -> None:
    from fleet_factory import make_report, write_host

    filename, make, reason = FLEET_FILES[name]
    work = tmp_path / "case"
    reports = work / "reports"
    write_host(reports, "host-a", make_report("cpu-tiny", "host-a"))
    write_host(reports, "host-b", make_report("cpu-tiny", "host-b"))
    if filename == "unreachable.json":
        (reports / "host-b" / "report.json").unlink()
    else:
        (reports / "host-b" / filename).unlink(missing_ok=True)
    make(reports / "host-b" / filename)
    before = snapshot(tmp_path)
    outcome = run(["fleet", "report", str(reports), "--out", str(work / "fleet")], work)
    assert outcome.code in (0, 1) and "Traceback" not in outcome.stderr, outcome.stderr
    assert_left_clean(tmp_path, before, [work / "fleet", tmp_path / "xdg-cache"])
    fleet_text = (work / "fleet" / "fleet.json").read_text()
    assert len(fleet_text) < 4 * 2**20  # nothing of the hostile file was copied in
    fleet = json.loads(fleet_text)
    assert {entry["host"] for entry in fleet["hosts"]} == {"host-a", "host-b"}
    reasons = [problem["reason"] for problem in fleet["problems"]]
    assert any(f"host-b/{filename}" in text and re.search(reason, text) for text in reasons), reasons


# --- the roofline's inputs, read on the serving host by its own python3 ----------------------------------------


@pytest.mark.parametrize("kind", ["sparse", "fifo", "nested"])
def test_roofline_inputs_name_an_unbounded_config_json(kind: str, tmp_path: Path) -> None:
    """roofline_inputs.py (standard library only, run on the host) says why the target's shape is unknown."""
    from b70host.roofline_inputs import JSON_LIMIT_BYTES

    work = tmp_path / "case"
    (work / "model").mkdir(parents=True)
    KINDS[kind](JSON_LIMIT_BYTES)(work / "model" / "config.json")
    outcome = run(["--model-dir", str(work / "model")], work, command=host_module("roofline_inputs"))
    assert outcome.code == 0 and "Traceback" not in outcome.stderr, outcome.stderr
    found = json.loads(outcome.stdout)
    assert "target_shape" not in found
    expected = {"sparse": r"over the \d+ this reads", "fifo": r"not a regular file",
                "nested": r"JSON nested too deeply"}[kind]
    assert re.search(expected, found["target_shape_unavailable"]), found


# --- a log is matched as it is read ---------------------------------------------------------------------------


def test_diagnose_reads_a_stream_once_and_keeps_only_the_evidence() -> None:
    """diagnose_lines takes the lines as they come (a generator: read once) and keeps the evidence alone."""
    from b70ctl.diagnose import diagnose_lines, load_catalogue
    from b70ctl.diagnose.model import LogLine

    handed: list[int] = []

    def lines():
        for number in range(1, 20_001):
            handed.append(number)
            text = ("kernel: Out of memory: Killed process 2159 (python3)" if number % 1000 == 0
                    else f"INFO 11-30 10:00:00 [loggers.py:123] line {number}")
            yield LogLine(log="x", kind="kernel" if number % 1000 == 0 else "serve", number=number, text=text)

    diagnosis = diagnose_lines(load_catalogue(), lines(), ["x"])
    assert handed == list(range(1, 20_001)) and diagnosis.lines_read == 20_000
    matched = [m for m in diagnosis.failures if m.evidence_count == 20]
    assert matched and all(len(m.evidence) <= 5 for m in diagnosis.failures)


def test_diagnose_stdin_past_the_cap_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """stdin has no size to check before: what is read is counted, and past the cap it is one line, exit 2."""
    import b70ctl.diagnose.collect as collect
    from hostile import run_b70ctl

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setattr(collect, "MAX_LOG_BYTES", 1000)
    outcome = run_b70ctl(["diagnose", "--log", "-"], stdin="INFO a line of a serve log\n" * 100)
    assert_one_line_error(outcome, 2, r"--log -: more, over the 1000 bytes cap: give the part around the failure")


# --- a host's sysfs and procfs, read under a root prefix -----------------------------------------------------


GPU_A = "0000:05:00.0"  # the first B70 of the b70x2-switch tree


def _replace_with(relative: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def spoil(root: Path) -> None:
        path = (root / relative).resolve() if (root / relative).is_symlink() else root / relative
        path.unlink()
        make(path)
    return spoil


def _device_attribute(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def spoil(root: Path) -> None:
        path = (root / "sys/bus/pci/devices" / GPU_A).resolve() / name
        path.unlink()
        make(path)
    return spoil


SYSFS_SPOILS = {
    # A file nothing writes to is read as missing, never waited on; /dev/zero as missing, never read to its end.
    "meminfo-fifo": (_replace_with("proc/meminfo", fifo), None),
    "cpuinfo-dev-zero": (_replace_with("proc/cpuinfo", dev_zero), None),
    "gpu-vendor-fifo": (_device_attribute("vendor", fifo), rf"{GPU_A}/vendor is not a regular file"),
    "gpu-resource-sparse": (_device_attribute("resource", sparse(2**31)), None),
}


@pytest.mark.parametrize("name", SYSFS_SPOILS)
def test_host_facts_read_a_fifo_or_device_in_the_tree_as_missing(name: str, tmp_path: Path) -> None:
    from sysfs_trees import build_tree

    spoil, warning = SYSFS_SPOILS[name]
    work = tmp_path / "case"
    work.mkdir()
    root = Path(build_tree(work, "b70x2-switch"))
    spoil(root)
    before = snapshot(tmp_path)
    outcome = run(["host", "facts", "--root", str(root), "--json"], work)
    assert_one_line_error(outcome, 0, "")
    assert "gpus" in json.loads(outcome.stdout)
    if warning is not None:
        assert any(re.search(warning, line) for line in outcome.warning_lines), outcome.stderr
    assert_left_clean(tmp_path, before, [tmp_path / "xdg-cache"])
