"""b70ctl diagnose: the catalogue against logs quoted from outside sources and logs captured from real vLLM CPU
(tests/fixtures/diagnose/README.md says where each came from), the topology contradiction, the journal and SSH
collection, and the command's exit codes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.diagnose import LogLine, diagnose_lines, load_catalogue, load_catalogue_file
from b70ctl.diagnose.catalogue import catalogue_files, catalogue_path
from b70ctl.diagnose.collect import collect_unit, kernel_log_argv, log_window, read_log, ssh_settings, unit_log_argv
from b70ctl.errors import BadInput
from b70host.topology import TOPOLOGY_PATH, topology
from sysfs_trees import build_tree

B70CTL = str(Path(sys.executable).with_name("b70ctl"))
REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "diagnose"

# Each fixture and exactly the catalogue ids it must produce (failures and harmless alike).
EXPECTED: dict[str, set[str]] = {
    "quoted/ze-ipc-no-p2p.log": {"ze-ipc-open-invalid-argument"},
    "quoted/hc-mult.log": {"dspark-drafter-routed-to-deepseek-v4"},
    "quoted/dspark-arch-unsupported.log": {"dspark-architecture-unsupported", "specforge-remote-code-warning"},
    "quoted/adaptive-gdn.log": {"adaptive-verification-gdn"},
    "quoted/esimd-bf16-query.log": {"esimd-page-attn-bf16-query"},
    "quoted/esimd-norm-gemv.log": {"esimd-norm-gemv-fp16-only"},
    "quoted/fp8-kv-esimd.log": {"fp8-kv-cache-esimd-crash"},
    "quoted/device-lost.log": {"device-lost-memory-profiling"},
    "quoted/tp2-hang.log": {"tp2-hang"},
    "quoted/stale-ipc.log": {"stale-ipc-handle-page-fault"},
    "quoted/host-oom-kernel.log": {"host-oom-killed"},
    "quoted/setvars-missing.log": {"oneapi-environment-not-sourced"},
    "quoted/garbage-report.json": {"silent-garbage-output"},
    "quoted/specforge-warning.log": {"specforge-remote-code-warning"},
    "quoted/lspci-2-5gts.log": {"pcie-link-2-5gts-cosmetic"},
    "quoted/ccl-narrow-affinity.log": {"ccl-narrow-affinity-warning"},
    "quoted/killed-sigkill.log": {"engine-killed-by-signal"},
    "quoted/dflash-renamed-arch.log": {"architecture-not-supported"},
    "real/missing-model.log": {"model-path-missing"},
    "quoted/shm-broadcast-cancelled.log": {"shm-broadcast-wait-cancelled"},
    "quoted/xe-gt-load-failed-wedged.log": {"layer-kernel-driver-error"},
    "quoted/ur-unsupported-feature.log": {"layer-level-zero-error"},
    "quoted/oneccl-device-fd-invalid.log": {"layer-oneccl-error"},
    "quoted/container-dri-nodes.log": {"layer-container-device-access"},
    "quoted/ze-out-of-device-memory-oneccl.log": {"device-out-of-memory"},
    # The compiler's error names a runtime code too: two layers, each with its first step.
    "quoted/inductor-ze-invalid-kernel-name.log": {"layer-torch-compile-error", "layer-level-zero-error"},
    "quoted/safetensors-header.log": {"layer-model-loader-error"},
    "quoted/vllm-unrecognized-option.log": {"vllm-unrecognized-option"},
    "quoted/torch-extension-undefined-symbol.log": {"torch-extension-abi-mismatch"},
    "quoted/oneccl-ze-data-not-initialized.log": {"oneccl-level-zero-not-loaded"},
}
REAL_EXPECTED_PATH = FIXTURES / "real" / "expected.json"


def expected_fixtures() -> dict[str, set[str]]:
    """The quoted fixtures above plus the real captures, whose expected ids are recorded beside them."""
    expected = dict(EXPECTED)
    if REAL_EXPECTED_PATH.is_file():
        expected.update({name: set(ids) for name, ids in json.loads(REAL_EXPECTED_PATH.read_text()).items()})
    return expected


def diagnose_file(name: str, **profile):
    return diagnose_lines(load_catalogue(), read_log(str(FIXTURES / name)), [name], **profile)


def found_ids(diagnosis) -> set[str]:
    return {match.id for match in diagnosis.failures + diagnosis.harmless}


@pytest.mark.parametrize("name", sorted(expected_fixtures()))
def test_each_fixture_names_exactly_its_failures(name: str) -> None:
    assert found_ids(diagnose_file(name)) == expected_fixtures()[name]


def test_every_catalogue_entry_has_a_fixture() -> None:
    # The field corpus (tests/fixtures/field/index.yaml, checked by test_diagnose_field.py) counts too.
    field = yaml.safe_load((FIXTURES.parent / "field" / "index.yaml").read_text()) or []
    covered = set().union(*expected_fixtures().values(), *(set(entry["expect"]) for entry in field))
    # A harmless entry is covered too by a healthy field log it explains (a healthy entry expects no failure).
    for entry in field:
        if entry["kind"] == "healthy":
            log = FIXTURES.parent / "field" / "logs" / f"{entry['id']}.log"
            covered |= {match.id for match in diagnose_lines(load_catalogue(), read_log(str(log)), [log.name]).harmless}
    assert {signature.id for signature in load_catalogue().signatures} == covered


def test_every_fixture_is_described_in_the_readme() -> None:
    readme = (FIXTURES / "README.md").read_text()
    missing = [name for name in expected_fixtures() if Path(name).name not in readme]
    assert not missing


def test_a_healthy_real_serve_log_matches_nothing() -> None:
    healthy = FIXTURES / "real" / "healthy.log"
    text = healthy.read_text()
    assert "SpecDecoding metrics" in text and "POST /v1/completions" in text  # it is the log it claims to be
    diagnosis = diagnose_file("real/healthy.log")
    assert diagnosis.lines_read > 50
    assert diagnosis.failures == [] and diagnosis.harmless == []


def test_an_engine_dead_error_is_harmless_only_beside_a_requested_stop() -> None:
    """The same real log without the engine's signal line: the EngineDeadError is a failure whose cause is not
    known again (requires holds the harmless reading to the stop)."""
    stopped = read_log(str(FIXTURES / "real/sigterm-stop.log"))
    assert diagnose_file("real/sigterm-stop.log").failures == []
    unexplained = [line for line in stopped if "trigger received signal" not in line.text]
    diagnosis = diagnose_lines(load_catalogue(), unexplained, ["x"])
    assert "engine-dead-at-requested-shutdown" not in found_ids(diagnosis)
    assert diagnosis.unknown is not None and any("EngineDeadError" in line.text
                                                 for line in diagnosis.unknown.lines)


def test_evidence_names_the_line_and_the_fix_comes_from_the_entry() -> None:
    diagnosis = diagnose_file("quoted/ze-ipc-no-p2p.log")
    [match] = diagnosis.failures
    assert [line.number for line in match.evidence] == [8]
    assert match.fix.profile == "no-p2p"
    assert match.fix.env["CCL_SYCL_ALLTOALL_TMP_BUF"] == "1"


def test_requires_keeps_a_signature_quiet_without_its_context() -> None:
    # The same ESIMD crash line without the fp8 KV cache line is not the FP8 KV failure.
    lines = [line for line in read_log(str(FIXTURES / "quoted/fp8-kv-esimd.log")) if "fp8" not in line.text]
    assert "fp8-kv-cache-esimd-crash" not in found_ids(diagnose_lines(load_catalogue(), lines, ["x"]))


def test_kernel_patterns_read_only_kernel_lines() -> None:
    # The OOM killer's kernel line, pasted without the journal's "kernel:" prefix, is not a kernel line.
    lines = read_log(str(FIXTURES / "quoted/host-oom-kernel.log"))
    kinds = {line.number: line.kind for line in lines}
    assert kinds[1] == kinds[2] == "kernel" and kinds[3] == "serve"


# Kernel lines as owners pasted them into public issues, one per shape, each with where it was posted.
KERNEL_LINE_SHAPES = [
    # dmesg: https://github.com/intel/media-driver/issues/1917
    "[    3.104594] xe 0000:01:00.0: [drm] Small BAR device",
    # dmesg -T: https://github.com/intel/llm-scaler/issues/595
    "[Tue Aug  4 20:51:21 2026] xe 0000:2b:00.0: [drm] Tile0: GT0: Check job timeout: seqno=1484958, "
    "lrc_seqno=1484958, guc_id=0, not started",
    # journalctl -k: https://github.com/intel/media-driver/issues/1889
    "Dec 07 07:03:57 bedroom kernel: xe 0000:03:00.0: [drm] Using GuC firmware from i915/dg1_guc_70.bin version "
    "70.29.2",
    # journalctl -k with only the time: https://github.com/clearlinux/distribution/issues/2907
    "22:39:31 kernel: i915 0000:00:02.0: [drm] GT0: GUC: SLPC enabled",
    # journalctl -k without time and host: https://github.com/lxc/incus-os/issues/891
    "kernel: xe 0000:0c:00.0: [drm] Tile0: GT0: GuC firmware xe/bmg_guc_70.bin: fetch failed with error -ENOENT",
    # a bare driver line: https://github.com/intel/compute-runtime/issues/948
    "xe 0000:83:00.0: [drm] Tile0: GT0: Fault response: Unsuccessful -ENOENT",
    # indented, after an ISO time stamp: https://github.com/intel/compute-runtime/issues/944
    "  2026-09-13T22:23:00 xe 0000:3d:00.0: [drm] Tile0: GT0: Engine reset: engine_class=ccs, logical_mask: 0x1, "
    "guc_id=9,",
    # dmesg -r: https://github.com/intel-gpu/intel-gpu-i915-backports/issues/192
    "<6>[    3.668430] i915 0000:0c:00.0: [drm] GT0: GuC firmware i915/dg2_guc_70.25.0.bin version 70.25.0",
    # dmesg -x: https://github.com/jakeday/linux-surface/issues/417
    "kern  :debug : [Thu Mar  7 18:50:57 2019] [drm:intel_uc_fw_fetch [i915]] GuC fw fetch SUCCESS",
    # a bare pcieport line inside a dmesg paste: https://github.com/geerlingguy/raspberry-pi-pcie-devices/issues/695
    "pcieport 0001:00:00.0: Assigned bridge window [mem 0x1800000000-0x1817ffffff 64bit pref] to [bus 01-04] "
    "cannot fit 0x200000000 required for 0001:02:01.0 bridging to [bus 03]",
]
SERVE_LINE_SHAPES = [
    # a wrapped kernel line's continuation is not a kernel line: https://github.com/intel/compute-runtime/issues/944
    "  state=0x29",
    # https://github.com/intel/llm-scaler/issues/348
    "2026-04-16T12:49:28.262466172Z (EngineCore_DP0 pid=568) ERROR 04-16 12:49:28 [core.py:936] RuntimeError: "
    "level_zero backend failed with error: 40 (UR_RESULT_ERROR_OUT_OF_RESOURCES)",
    # https://github.com/intel/compute-runtime/issues/921
    "  sycl::_V1::exception: level_zero backend failed with error: 2147483646 (UR_RESULT_ERROR_UNKNOWN)",
]


@pytest.mark.parametrize("line", KERNEL_LINE_SHAPES)
def test_kernel_lines_are_read_in_every_shape_they_are_pasted_in(tmp_path: Path, line: str) -> None:
    log = tmp_path / "pasted.log"
    log.write_text(line + "\n")
    assert [read.kind for read in read_log(str(log))] == ["kernel"]


@pytest.mark.parametrize("line", SERVE_LINE_SHAPES)
def test_server_lines_are_not_taken_for_kernel_lines(tmp_path: Path, line: str) -> None:
    log = tmp_path / "pasted.log"
    log.write_text(line + "\n")
    assert [read.kind for read in read_log(str(log))] == ["serve"]


# ---------------------------------------------------------------- the catalogue file is validated

def _write_catalogue(tmp_path: Path, mutate) -> Path:
    # The shipped folder's files as one document, as the loader merges them.
    files = catalogue_files(catalogue_path())
    data = {"schema_version": 1,
            "signatures": [entry for file in files for entry in yaml.safe_load(file.read_text())["signatures"]]}
    mutate(data)
    path = tmp_path / "catalogue.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _entry(data: dict, id: str) -> dict:
    return next(entry for entry in data["signatures"] if entry["id"] == id)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["signatures"][0]["patterns"][0].update(regex="(unclosed"), "not a regular expression"),
    (lambda d: d["signatures"].append(d["signatures"][0]), "duplicate signature id"),
    (lambda d: _entry(d, "ccl-narrow-affinity-warning")["fix"].update(kind="env"),
     "harmless entry's fix kind must be none"),
    (lambda d: _entry(d, "vllm-unrecognized-option")["fix"].update(text="Remove ${option}."),
     "the fix names \\$\\{option\\}, which pattern"),
    (lambda d: d["signatures"][0]["patterns"][0].update(kinds=["dmesg"]), "signatures.0.patterns.0.kinds.0"),
    (lambda d: d["signatures"][0].pop("sources"), "signatures.0.sources"),
    (lambda d: d["signatures"][0].update(unless=["no-such-entry"]), "unless names unknown signature no-such-entry"),
    (lambda d: _entry(d, "ze-ipc-open-invalid-argument")["causes"].reverse(),
     "fix must be the first"),
])
def test_a_bad_catalogue_is_refused_with_the_field(tmp_path: Path, mutate, message: str) -> None:
    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_catalogue_file(_write_catalogue(tmp_path, mutate))


def test_a_catalogue_folder_is_one_document_with_ids_unique_across_files(tmp_path: Path) -> None:
    files = catalogue_files(catalogue_path())
    assert [file.name for file in files] == ["layers.yaml", "platform.yaml", "serving.yaml"]
    folder = tmp_path / "catalogue"
    folder.mkdir()
    first = yaml.safe_load(files[0].read_text())
    (folder / "a.yaml").write_text(yaml.safe_dump(first))
    (folder / "b.yaml").write_text(yaml.safe_dump({"schema_version": 1, "signatures": first["signatures"][:1]}))
    with pytest.raises(BadInput, match=f"duplicate signature id {first['signatures'][0]['id']}"):
        load_catalogue_file(folder)
    broken = {"schema_version": 1, "signatures": [dict(first["signatures"][0], id="Not An Id")]}
    (folder / "b.yaml").write_text(yaml.safe_dump(broken))
    with pytest.raises(BadInput, match=r"b\.yaml: signatures\.0\.id"):
        load_catalogue_file(folder)


def test_a_key_given_twice_in_a_catalogue_file_is_refused_not_overwritten(tmp_path: Path) -> None:
    """A hand-edited catalogue with a second `schema_version` (or a second `fix:` in an entry) was read keeping the
    last one silently; catalogue files are read like recipes now."""
    shipped = catalogue_files(catalogue_path())[0].read_text()
    path = tmp_path / "platform.yaml"
    path.write_text(shipped + "schema_version: 2\n")
    with pytest.raises(BadInput, match=r"catalogue \S+platform\.yaml: key 'schema_version' on line \d+ is given "
                                       r"already on line \d+: keep one"):
        load_catalogue_file(path)


def test_every_source_of_the_shipped_catalogue_can_be_followed() -> None:
    # docs and capture sources are files of this repository, and a docs section is one of the file's headings.
    catalogue = load_catalogue_file(catalogue_path(), repository=REPO)
    kinds = {source.kind for signature in catalogue.signatures for source in signature.sources}
    assert kinds == {"docs", "capture", "issue", "upstream"}


# The refs below are deliberately ones a reader cannot follow: test_citations skips lines marked "not a citation".
@pytest.mark.parametrize("source, message", [
    ({"kind": "docs", "ref": "docs/nowhere.md: Hardware"}, "docs/nowhere.md is not a file of"),  # not a citation
    ({"kind": "docs", "ref": "docs/facts.md: Nowhere"}, "docs/facts.md has no section 'Nowhere'"),
    ({"kind": "docs", "ref": "FACTS.md: Hardware"}, "a docs source is docs/<file>.md"),  # not a citation
    ({"kind": "capture", "ref": "tests/fixtures/diagnose/real/nowhere.log"}, "is not a file of the repository"),
    ({"kind": "capture", "ref": "tests/fixtures/../../README.md"}, "is not a file of"),  # not a citation
    ({"kind": "capture", "ref": "seeds/000"}, "a capture source is a file under tests/fixtures/"),  # not a citation
    ({"kind": "issue", "ref": "seeds/000 (a comment)"}, "an issue source is the https URL"),  # not a citation
    ({"kind": "seed", "ref": "seeds/000"}, "signatures.0.sources.0.kind"),  # not a citation
])
def test_a_source_a_reader_cannot_follow_is_refused(tmp_path: Path, source: dict, message: str) -> None:
    path = _write_catalogue(tmp_path, lambda d: d["signatures"][0].update(sources=[source]))
    with pytest.raises(BadInput, match=re.escape(message)):
        load_catalogue_file(path, repository=REPO)


def test_without_the_repository_only_the_shape_of_a_source_is_checked(tmp_path: Path) -> None:
    # The installed package has no repository beside it: b70ctl diagnose still loads its catalogue.
    source = {"kind": "docs", "ref": "docs/nowhere.md: Hardware"}  # not a citation
    path = _write_catalogue(tmp_path, lambda d: d["signatures"][0].update(sources=[source]))
    assert load_catalogue_file(path).signatures[0].sources[0].ref == source["ref"]


# ---------------------------------------------------------------- topology contradiction

def _topology_file(tmp_path: Path, scenario: str, profile: str) -> Path:
    root = build_tree(tmp_path, scenario)
    topology(root, 2, profile=profile, probe="never", write=True)
    return Path(root) / TOPOLOGY_PATH.lstrip("/")


def test_no_p2p_host_forced_to_p2p_contradicts_the_catalogue(tmp_path: Path) -> None:
    forced = _topology_file(tmp_path, "b70x2-root-ports", "p2p")
    result = CliRunner().invoke(app, ["diagnose", "--log", str(FIXTURES / "quoted/ze-ipc-no-p2p.log"),
                                      "--topology", str(forced), "--json"])
    assert result.exit_code == 1
    [contradiction] = json.loads(result.stdout)["contradictions"]
    assert contradiction["signature"] == "ze-ipc-open-invalid-argument" and contradiction["profile"] == "p2p"
    assert "no-p2p" in contradiction["text"]


def test_forced_p2p_on_a_no_p2p_host_is_named_before_it_fails(tmp_path: Path) -> None:
    forced = _topology_file(tmp_path, "b70x2-root-ports", "p2p")
    result = CliRunner().invoke(app, ["diagnose", "--log", str(FIXTURES / "real/healthy.log"),
                                      "--topology", str(forced), "--json"])
    assert result.exit_code == 1
    assert [c["signature"] for c in json.loads(result.stdout)["contradictions"]] == ["ze-ipc-open-invalid-argument"]


def test_the_topology_s_own_profile_contradicts_nothing(tmp_path: Path) -> None:
    for scenario in ("b70x2-root-ports", "b70x2-switch"):
        chosen = _topology_file(tmp_path / scenario, scenario, "auto")
        result = CliRunner().invoke(app, ["diagnose", "--log", str(FIXTURES / "real/healthy.log"),
                                          "--topology", str(chosen), "--json"])
        assert result.exit_code == 0, result.stdout
        assert json.loads(result.stdout)["contradictions"] == []


# ---------------------------------------------------------------- the command

def test_exit_codes_and_json() -> None:
    runner = CliRunner()
    failing = runner.invoke(app, ["diagnose", "--log", str(FIXTURES / "quoted/adaptive-gdn.log"), "--json"])
    assert failing.exit_code == 1
    assert [m["id"] for m in json.loads(failing.stdout)["failures"]] == ["adaptive-verification-gdn"]
    healthy = runner.invoke(app, ["diagnose", "--log", str(FIXTURES / "real/healthy.log")])
    assert healthy.exit_code == 0 and "no known failure" in healthy.stdout
    harmless_only = runner.invoke(app, ["diagnose", "--log", str(FIXTURES / "quoted/specforge-warning.log")])
    assert harmless_only.exit_code == 0 and "harmless" in harmless_only.stdout


def test_human_output_prints_failure_evidence_and_fix() -> None:
    result = CliRunner().invoke(app, ["diagnose", "--log", str(FIXTURES / "quoted/esimd-bf16-query.log")])
    assert result.exit_code == 1
    assert "FAILURE esimd-page-attn-bf16-query" in result.stdout
    assert "esimd-bf16-query.log:1:" in result.stdout
    assert "DISABLE_ESIMD_PAGE_ATTN=1" in result.stdout


def test_several_settled_causes_are_printed_in_order_and_in_json() -> None:
    # The four threads that settled zeMemOpenIpcHandle INVALID_ARGUMENT, each on its own fix:
    # SergiioB/intel-arc-pro-b70-inference-cookbook #8 and intel/llm-scaler #594 ("your host platform does not
    # support P2P": the SIMPLE_THRESHOLD exports), vllm-project/vllm #48953 ("new xpu kernel 0.1.12 works but:
    # need CCL_ENABLE_SYCL_KERNELS=0"), intel/llm-scaler #486 ("Update your kernel to 7.1 and ubuntu to 26.04"),
    # intel/llm-scaler #398 ("Non-AWQ models (FP16) work correctly").
    log = str(FIXTURES / "quoted/ze-ipc-no-p2p.log")
    text = CliRunner().invoke(app, ["diagnose", "--log", log]).stdout
    marks = ["CCL_SYCL_ALLREDUCE_SIMPLE_THRESHOLD=4294967296", "CCL_ENABLE_SYCL_KERNELS=0", "kernel 7.1", "AWQ"]
    positions = [text.index(mark) for mark in marks]
    assert positions == sorted(positions) and "how to tell" in text
    [match] = json.loads(CliRunner().invoke(app, ["diagnose", "--log", log, "--json"]).stdout)["failures"]
    assert [cause["fix"]["kind"] for cause in match["causes"]] == ["profile", "env", "host", "recipe"]
    assert match["causes"][0]["fix"] == match["fix"]


def test_stdin_is_read_with_dash() -> None:
    text = (FIXTURES / "quoted/tp2-hang.log").read_text()
    result = CliRunner().invoke(app, ["diagnose", "--log", "-", "--json"], input=text)
    # The wait alone shows none of tp2-hang's causes: its layer's first step, exit 3 (failure, cause unknown).
    assert result.exit_code == 3
    assert json.loads(result.stdout)["failures"][0]["evidence"][0]["log"] == "stdin"


@pytest.mark.parametrize("args, message", [
    ([], "nothing to read"),
    (["--log", "/nonexistent/vllm.log"], "No such file"),
    (["--unit", "bad unit;rm"], "not a systemd unit name"),
    (["--ssh", "host", "--log", "x.log"], "give one or the other"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = subprocess.run([B70CTL, "diagnose", *args], capture_output=True, text=True)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------- collection

UNIT_JOURNAL = """\
2026-11-30T10:00:05+0100 b70-a docker[811]: INFO Starting vLLM API server
2026-11-30T10:03:40+0100 b70-a systemd[1]: b70-vllm.service: A process of this unit has been killed by the OOM killer.
"""


def test_unit_and_kernel_commands() -> None:
    assert unit_log_argv("b70-vllm") == ["journalctl", "--unit", "b70-vllm", "--no-pager", "--output", "short-iso",
                                         "--lines", "3000"]
    window = log_window(UNIT_JOURNAL)
    assert window == (datetime(2026, 11, 30, 9, 0, 5, tzinfo=UTC),
                      datetime(2026, 11, 30, 9, 3, 40, tzinfo=UTC))
    assert kernel_log_argv(window) == ["journalctl", "-k", "--no-pager", "--output", "short-iso",
                                       "--since", "2026-11-30 08:55:05 UTC", "--until", "2026-11-30 09:08:40 UTC",
                                       "--lines", "2000"]
    assert kernel_log_argv(None)[-2:] == ["--lines", "2000"]
    with pytest.raises(BadInput):
        unit_log_argv("b70-vllm; reboot")


def test_collect_unit_reads_the_journal_then_the_kernel_log_around_it() -> None:
    calls: list[list[str]] = []
    kernel = ("2026-11-30T10:03:39+0100 b70-a kernel: Out of memory: Killed process 2159 (python3) total-vm:1kB, "
              "anon-rss:1kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0\n")

    def run(argv: list[str]) -> tuple[int, str, str]:
        calls.append(argv)
        return (0, UNIT_JOURNAL, "") if "--unit" in argv else (0, kernel, "")

    lines, names = collect_unit(run, "b70-vllm", where="b70-a")
    assert calls[1][:2] == ["journalctl", "-k"] and "--since" in calls[1]
    assert names == ["b70-a:b70-vllm", "b70-a:kernel"]
    diagnosis = diagnose_lines(load_catalogue(), lines, names)
    [oom] = [m for m in diagnosis.failures if m.id == "host-oom-killed"]
    assert {line.kind for line in oom.evidence} == {"serve", "kernel"}


def test_collect_unit_errors() -> None:
    with pytest.raises(BadInput, match="journalctl --unit b70-vllm on b70-a failed"):
        collect_unit(lambda argv: (1, "", "Failed to add filter for units: No data available"), "b70-vllm", "b70-a")
    # An unreadable kernel log is noted; the unit's log is still read.
    lines, names = collect_unit(lambda argv: (0, UNIT_JOURNAL, "") if "--unit" in argv else (1, "", "denied"),
                                "b70-vllm")
    assert len(lines) == 2 and names[1] == "kernel (unreadable: denied)"


def test_ssh_settings_honour_the_ssh_config(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Host b70-a\n  HostName 10.0.0.7\n  Port 2222\n  User ops\n  IdentityFile ~/.ssh/b70\n")
    settings = ssh_settings("b70-a", config)
    assert (settings["hostname"], settings["port"], settings["username"]) == ("10.0.0.7", 2222, "ops")
    assert settings["key_filename"][0].endswith("/.ssh/b70")
    assert ssh_settings("other", config)["hostname"] == "other"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_ssh_host_is_exit_2_in_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(f"Host b70-gone\n  HostName 127.0.0.1\n  Port {_closed_port()}\n")
    env = {**os.environ, "HOME": str(home)}
    env.pop("SSH_AUTH_SOCK", None)
    done = subprocess.run([B70CTL, "diagnose", "--ssh", "b70-gone"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert "ssh b70-gone (127.0.0.1:" in done.stderr and "unreachable" in done.stderr


# ---------------------------------------------------------------- reading large logs

ALL_LOGS = sorted((FIXTURES.parent / "field" / "logs").glob("*.log")) + sorted(FIXTURES.rglob("*.log"))


def test_the_prefilter_lets_every_line_a_pattern_matches_reach_that_pattern() -> None:
    # Every real line of the corpus that some catalogue pattern or context probe matches must reach its reader:
    # the prefilter may let too much through, never too little.
    from b70ctl.diagnose import context
    from b70ctl.diagnose.match import _prefilter_for

    catalogue = load_catalogue()
    prefilter = _prefilter_for(catalogue)
    assert not prefilter.everything
    readers = [(index, re.compile(pattern.regex)) for index, signature in enumerate(catalogue.signatures)
               for pattern in [*signature.all_patterns(), *signature.requires,
                               *(evidence for cause in signature.causes for evidence in cause.evidence)]]
    readers += [(-1 - index, pattern) for index, (_, _, pattern) in enumerate(context.probes())]
    checked = 0
    for log in ALL_LOGS:
        texts = log.read_text(errors="replace").splitlines()
        through = dict(prefilter.candidates(texts))
        for number, text in enumerate(texts):
            for reader, regex in readers:
                if regex.search(text):
                    checked += 1
                    assert reader in through.get(number, frozenset()), (log.name, number + 1, regex.pattern)
                    assert reader in prefilter.readers(text)
    assert checked > 100


@pytest.mark.parametrize("read_chars", [1, 3, 7, 64])
def test_a_log_read_in_pieces_has_the_lines_splitlines_gives(tmp_path: Path, monkeypatch, read_chars: int) -> None:
    # \r\n cut between two reads, a lone \r, form feeds, a last line without an end, empty lines.
    from b70ctl.diagnose import collect

    text = "first\r\nsecond\rthird\n\nfourth\x0cfifth\r\n\r\nsixth\u2028seventh\r"
    log = tmp_path / "pieces.log"
    log.write_bytes(text.encode())
    monkeypatch.setattr(collect, "READ_CHARS", read_chars)
    assert [line.text for line in read_log(str(log))] == text.splitlines()
    assert [line.number for line in read_log(str(log))] == list(range(1, len(text.splitlines()) + 1))


def test_a_line_longer_than_a_read_is_kept_to_its_first_characters(tmp_path: Path, monkeypatch) -> None:
    from b70ctl.diagnose import collect

    monkeypatch.setattr(collect, "READ_CHARS", 1000)
    monkeypatch.setattr(collect, "MAX_KEPT_LINE_CHARS", 2500)
    log = tmp_path / "long.log"
    log.write_text("x" * 10_000 + "\nnext\n")
    assert [line.text for line in read_log(str(log))] == ["x" * 2500, "next"]


def test_batches_and_lines_give_the_same_diagnosis() -> None:
    from b70ctl.diagnose.collect import stream_log_batches

    for log in ALL_LOGS:
        by_line = diagnose_lines(load_catalogue(), read_log(str(log)), [log.name])
        by_batch = diagnose_lines(load_catalogue(), stream_log_batches(str(log)), [log.name])
        assert by_line.model_dump() == by_batch.model_dump(), log.name


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    # A role or a pipe reads stderr: a long log read there prints nothing but the diagnosis.
    from b70ctl.diagnose import cli as diagnose_cli

    log = tmp_path / "big.log"
    with log.open("w") as out:
        out.truncate(diagnose_cli.PROGRESS_MIN_BYTES + 1)
    assert diagnose_cli._progress([str(log)]) is None


# ---------------------------------------------------------------- layers, codes, causes, "not known"

def test_out_of_device_memory_is_headroom_first_whether_named_or_numbered() -> None:
    # intel/intel-extension-for-pytorch#640 names ZE's code; ggml-org/llama.cpp#25286 prints UR's "error: 39".
    # Neither log shows the multi-GPU peer-access bug's own evidence, so the first step is vLLM's memory budget.
    field_log = FIXTURES.parent / "field" / "logs" / "k-llama-cpp-25286-2x-b70-device-lost-out-of-device-memory.log"
    for lines in (read_log(str(FIXTURES / "quoted/ze-out-of-device-memory-oneccl.log")),
                  [line for line in read_log(str(field_log)) if "error: 39" in line.text]):
        named = {match.id: match for match in diagnose_lines(load_catalogue(), lines, ["log"]).failures}
        match = named["device-out-of-memory"]
        assert match.picked_cause is None
        assert match.fix.kind == "recipe" and "--gpu-memory-utilization" in match.fix.text
        # The peer-access cause is listed with its fix, not picked.
        assert any("kernel 7.1" in cause.fix.text for cause in match.causes[1:]) and not match.fix.env
    numbered_only = [line.model_copy(update={"text": line.text.replace(" [UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY]", "")})
                     for line in read_log(str(field_log)) if "error: 39" in line.text]
    assert "UR_RESULT" not in numbered_only[0].text
    assert [match.id for match in diagnose_lines(load_catalogue(), numbered_only, ["log"]).failures] == [
        "device-out-of-memory"]


def test_a_cause_is_picked_only_with_its_own_evidence_in_the_log(tmp_path: Path) -> None:
    # The no-P2P line alone: the first cause's fix, nothing picked. With the AWQ config echo vLLM prints (its
    # `quantization=awq` engine line, intel/llm-scaler#398's model), the AWQ cause and its fix.
    base = (FIXTURES / "quoted/ze-ipc-no-p2p.log").read_text()
    [plain] = diagnose_lines(load_catalogue(), read_log(str(FIXTURES / "quoted/ze-ipc-no-p2p.log")), ["log"]).failures
    assert plain.picked_cause is None and plain.fix.profile == "no-p2p"
    log = tmp_path / "awq.log"
    log.write_text("INFO 07-17 12:28:50 [core.py:93] Initializing a V1 LLM engine (v0.14.0) with config: "
                   "model='/llm/models/Qwen3-32B-AWQ', quantization=awq, tensor_parallel_size=2\n" + base)
    [awq] = diagnose_lines(load_catalogue(), read_log(str(log)), ["log"], profile="p2p",
                           profile_source="topology").failures
    assert awq.picked_cause == 3 and awq.fix.kind == "recipe" and "FP16" in awq.fix.text
    assert [line.number for line in awq.cause_evidence] == [1]
    # The profile is not what failed there: no contradiction, and the serve gate's no-p2p fallback stays off.
    found = diagnose_lines(load_catalogue(), read_log(str(log)), ["log"], profile="p2p", profile_source="topology")
    assert found.contradictions == []


def test_a_stopped_server_s_broadcast_wait_is_not_called_a_hang() -> None:
    result = CliRunner().invoke(app, ["diagnose", "--log", str(FIXTURES / "quoted/shm-broadcast-cancelled.log"),
                                      "--json"])
    document = json.loads(result.stdout)
    assert [match["id"] for match in document["failures"]] == ["shm-broadcast-wait-cancelled"]
    assert document["failures"][0]["generic"] is True
    assert result.exit_code == 3


def test_a_layer_without_a_named_cause_exits_3_with_its_first_step() -> None:
    result = CliRunner().invoke(app, ["diagnose", "--log", str(FIXTURES / "quoted/ur-unsupported-feature.log")])
    assert result.exit_code == 3
    assert "layer level-zero, cause not known" in result.stdout and "ZE_AFFINITY_MASK=0" in result.stdout
    # The code's number and meaning, as oneapi-src/unified-runtime's header gives them.
    assert "code UR_RESULT_ERROR_UNSUPPORTED_FEATURE = 44: [Validation] generic error code for unsupported features" \
        in result.stdout
    assert "cause is not known" in result.stdout.splitlines()[-1]


def test_a_failure_no_entry_names_prints_its_lines_layer_and_versions(tmp_path: Path) -> None:
    # A real vLLM CPU start whose worker could not allocate, without the lines its entry reads: the engine's own
    # "initialization failed" is still a failure, printed with the version and settings the log echoed.
    entry = next(signature for signature in load_catalogue().signatures
                 if signature.id == "host-memory-allocation-failed")
    lines = [line.text for line in read_log(str(FIXTURES / "real/memory-limit.log"))
             if not any(re.search(pattern.regex, line.text) for pattern in entry.patterns)]
    log = tmp_path / "unknown.log"
    log.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(app, ["diagnose", "--log", str(log), "--json"])
    assert result.exit_code == 3
    document = json.loads(result.stdout)
    assert document["failures"] == []
    assert "Engine core initialization failed" in document["unknown"]["lines"][0]["text"]
    assert document["context"]["versions"]["vllm"] == "0.32.0"
    assert document["context"]["settings"]["max_model_len"] == "2048"
    text = CliRunner().invoke(app, ["diagnose", "--log", str(log)]).stdout
    assert "cause not known" in text and "versions in the log: vllm 0.32.0" in text


def test_the_failing_call_is_read_from_the_trace() -> None:
    # The real capture of a KV cache too large for the host: it died in vLLM's memory profiling.
    assert diagnose_file("real/kv-cache-too-large.log").context.failing_call == "profile run"


def test_a_healthy_log_has_no_decisive_line() -> None:
    field = yaml.safe_load((FIXTURES.parent / "field" / "index.yaml").read_text())
    for entry in field:
        if entry["kind"] == "healthy":
            log = FIXTURES.parent / "field" / "logs" / f"{entry['id']}.log"
            assert diagnose_lines(load_catalogue(), read_log(str(log)), [log.name]).unknown is None, entry["id"]
    assert diagnose_file("real/healthy.log").unknown is None


def test_the_guc_the_kernel_log_shows_picks_the_engine_reset_cause(tmp_path: Path) -> None:
    # The firmware line as xe prints it (geerlingguy/raspberry-pi-pcie-devices#695, an Arc B580's dmesg) ahead of
    # the engine resets of intel/compute-runtime#948: a GuC before 70.65 picks the firmware update.
    field_log = FIXTURES.parent / "field" / "logs" / "k-compute-runtime-948-b580-guc-70-58-enoent.log"
    guc_line = ("[    3.884544] xe 0000:03:00.0: [drm] Using GuC firmware from xe/bmg_guc_70.bin version 70.36.0\n")
    log = tmp_path / "kernel.log"
    log.write_text(guc_line + field_log.read_text())
    [reset] = [match for match in diagnose_lines(load_catalogue(), read_log(str(log)), ["log"]).failures
               if match.id == "xe-engine-reset-fault"]
    assert reset.picked_cause == 0 and "70.65" in reset.fix.text
    assert [line.number for line in reset.cause_evidence] == [1]
    # The same resets after a GuC of 70.65 or newer: not the firmware's age, whatever the first cause says.
    log.write_text(guc_line.replace("70.36.0", "70.72.1") + field_log.read_text())
    [reset] = [match for match in diagnose_lines(load_catalogue(), read_log(str(log)), ["log"]).failures
               if match.id == "xe-engine-reset-fault"]
    not_age = next(index for index, cause in enumerate(reset.causes)
                   if cause.cause.startswith("Not the firmware's age"))
    assert reset.picked_cause == not_age and reset.fix == reset.causes[not_age].fix


def test_no_xpu_device_with_an_unreadable_render_node_picks_the_device_nodes(tmp_path: Path) -> None:
    # vllm-project/vllm#48625's "XPU device count is zero", beside a container's refused render node (the line
    # netbrain/zwift#230 posted): the libraries loaded; the device nodes are the cause, not LD_LIBRARY_PATH.
    field_log = FIXTURES.parent / "field" / "logs" / "k-vllm-48625-b70-xpu-device-count-zero.log"
    log = tmp_path / "serve.log"
    log.write_text("failed to open /dev/dri/renderD129: Permission denied\n" + field_log.read_text())
    found = diagnose_lines(load_catalogue(), read_log(str(log)), ["log"])
    [match] = [match for match in found.failures if match.id == "oneapi-environment-not-sourced"]
    assert match.picked_cause == 3 and "--group-add render" in match.fix.text
    assert not any(match.generic for match in found.failures)  # the specific entry speaks, not the layer's
    [alone] = diagnose_lines(load_catalogue(), read_log(str(field_log)), ["log"]).failures
    assert alone.picked_cause is None and "LD_LIBRARY_PATH" in alone.fix.text


def test_a_lost_device_names_a_cause_only_on_its_own_line(tmp_path: Path) -> None:
    # UR_RESULT_ERROR_DEVICE_LOST alone: the Level Zero layer's first step (read the kernel log), exit 3, no remedy.
    log = tmp_path / "serve.log"
    log.write_text("RuntimeError: level_zero backend failed with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)\n")
    [lost] = [m for m in diagnose_lines(load_catalogue(), read_log(str(log)), ["log"]).failures
              if m.id == "device-lost"]
    assert lost.generic and lost.picked_cause is None
    # With the devcoredump's GuC line the GuC cause is picked and the entry speaks as a specific one.
    log.write_text(log.read_text() + "GuC version: 70.58.0 (wanted 70.54.0)\n")
    [lost] = [m for m in diagnose_lines(load_catalogue(), read_log(str(log)), ["log"]).failures
              if m.id == "device-lost"]
    assert not lost.generic and "GuC" in lost.causes[lost.picked_cause or 0].cause and lost.picked_cause == 1


def test_a_sycl_soname_major_is_not_read_as_an_unsourced_environment(tmp_path: Path) -> None:
    # libsycl.so.7 missing may be an unloaded environment or a binary built for another oneAPI release: the line does
    # not say which, so the layer's answer lists both; an unversioned oneCCL library is the environment's.
    log = tmp_path / "serve.log"
    log.write_text("./ollama: error while loading shared libraries: libsycl.so.7: cannot open shared object file: "
                   "No such file or directory\n")
    found = diagnose_lines(load_catalogue(), read_log(str(log)), ["log"]).failures
    assert [(m.id, m.generic) for m in found] == [("sycl-runtime-soname-not-found", True)]
    log.write_text("Cannot open plugin library: libccl.so.1: cannot open shared object file\n")
    found = diagnose_lines(load_catalogue(), read_log(str(log)), ["log"]).failures
    assert [m.id for m in found] == ["oneapi-environment-not-sourced"]


def test_a_fix_names_what_the_line_caught() -> None:
    """${name} in a fix is what the pattern's named group caught in the first matching line: the option this vLLM
    refused is the one the fix says to remove, whatever option it is."""
    [match] = diagnose_file("quoted/vllm-unrecognized-option.log").failures
    assert "Remove --async-engine from the server's command line" in match.fix.text
    lines = [LogLine(log="serve.log", kind="serve", number=1,
                     text="vllm serve: error: unrecognized arguments: --swap-space 0 --device cpu")]
    [other] = diagnose_lines(load_catalogue(), lines, ["serve.log"]).failures
    assert "Remove --swap-space 0 --device cpu from" in other.fix.text and "${" not in other.fix.text
