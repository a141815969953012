"""verify end to end against scripted servers: the report, partial reports, exit codes and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from b70ctl.checks.client import Endpoint
from b70ctl.errors import BadInput, Unreachable
from b70ctl.recipes.model import Claim
from b70ctl.verify.pipeline import VerifyRequest, verify
from scripted_server import SHORT_RATE, Script, ScriptedServer, request_for, scripted_recipe

IMPOSSIBLE = Claim(id="impossible", description="too fast", metric="throughput.short.decode_tok_s.median",
                   op=">=", value=1e9, source="test")
ACCEPTANCE = Claim(id="acceptance", description="acceptance", metric="throughput.short.acceptance_rate",
                   op="between", low=0.6, high=0.65, source="test")
UNMEASURED = Claim(id="long", description="long prompt", metric="throughput.long_prompt.decode_tok_s.median",
                   op=">=", value=1.0, source="test")


def test_full_run_writes_report_with_verdicts(servers, tmp_path):
    served, baseline = servers
    recipe = scripted_recipe(SHORT_RATE, ACCEPTANCE, IMPOSSIBLE, UNMEASURED)
    report = verify(request_for(recipe, served, baseline, tmp_path))

    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["partial"] is False and on_disk["schema_version"] == 4
    assert report.smoke.passed and report.correctness.passed and report.throughput.passed
    assert (report.correctness.identical, report.correctness.total) == (3, 3)
    verdicts = {v.claim_id: v.verdict for v in report.verdicts}
    # The scripted server accepts 25 of 40 draft tokens per request: 0.625.
    assert report.measurements["throughput.short.acceptance_rate"] == pytest.approx(0.625)
    assert verdicts == {"short-rate": "met", "acceptance": "met", "impossible": "not_met", "long": "not_measured"}
    assert report.passed is False  # one claim not met
    markdown = (tmp_path / "report.md").read_text()
    for heading in ("## Configuration", "## Verdicts", "## Throughput", "## Correctness and stability",
                    "## Edge cases and smoke"):
        assert heading in markdown
    assert "3/3 identical" in markdown
    assert list((tmp_path / "raw" / "throughput" / "short").glob("00*.json"))


def test_all_claims_met_passes(servers, tmp_path):
    served, baseline = servers
    report = verify(request_for(scripted_recipe(SHORT_RATE), served, baseline, tmp_path))
    assert report.passed is True


def test_max_requests_caps_every_workload_and_the_report_says_so(servers, tmp_path):
    served, baseline = servers
    report = verify(request_for(scripted_recipe(SHORT_RATE), served, baseline, tmp_path, max_requests=1))
    assert [len(w.requests) for w in report.throughput.workloads] == [1, 1]  # the recipe asks 3 and 2
    assert report.throughput.max_requests == 1
    assert json.loads((tmp_path / "report.json").read_text())["throughput"]["max_requests"] == 1
    assert "At most 1 request(s) per workload (`--max-requests`)" in (tmp_path / "report.md").read_text()
    # Without the cap, the recipe's own counts and no such line.
    full = verify(request_for(scripted_recipe(SHORT_RATE), served, baseline, tmp_path / "full"))
    assert [len(w.requests) for w in full.throughput.workloads] == [3, 2] and full.throughput.max_requests is None
    assert "--max-requests" not in (tmp_path / "full" / "report.md").read_text()


def test_interrupted_run_leaves_a_partial_report(servers, tmp_path):
    served, baseline = servers

    def interrupt(message: str) -> None:
        if message.startswith("short: request 2"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        verify(request_for(scripted_recipe(SHORT_RATE), served, baseline, tmp_path), progress=interrupt)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["partial"] is True and on_disk["partial_reason"] == "interrupted"
    assert on_disk["smoke"]["passed"] is True and on_disk["correctness"]["identical"] == 3
    assert on_disk["passed"] is False
    assert "PARTIAL" in (tmp_path / "report.md").read_text()


def test_http_500_fails_a_check_and_keeps_the_rest(servers, tmp_path):
    served, baseline = servers
    served.scripts["tell"] = Script(ttft_s=0.01, offsets_s=[0.0], tokens_per_chunk=[2], mode="http500")
    report = verify(request_for(scripted_recipe(SHORT_RATE), served, baseline, tmp_path))
    natural = {w.name: w for w in report.throughput.workloads}["natural"]
    assert "HTTP 500" in natural.error
    assert report.throughput.passed is False and report.passed is False
    assert report.measurements["throughput.short.decode_tok_s.median"] > 0


def test_unreachable_endpoint_is_unreachable_with_exit_2_and_writes_nothing(tmp_path):
    recipe = scripted_recipe(SHORT_RATE)
    with ScriptedServer() as baseline:
        request = VerifyRequest(recipe=recipe, out_dir=tmp_path, endpoint=Endpoint("http://127.0.0.1:9", timeout_s=2),
                                baseline_endpoint=Endpoint(baseline.url, timeout_s=2))
        with pytest.raises(Unreachable, match=r"endpoint http://127.0.0.1:9 unreachable: .*connection refused") \
                as refused:
            verify(request)
    assert refused.value.exit_code == 2 and not isinstance(refused.value, BadInput)
    assert not (tmp_path / "report.json").exists()


def test_wrong_model_is_bad_input(servers, tmp_path):
    served, baseline = servers
    recipe = scripted_recipe(SHORT_RATE)
    request = VerifyRequest(recipe=recipe, out_dir=tmp_path, endpoint=Endpoint(served.url, model="other"),
                            baseline_endpoint=Endpoint(baseline.url))
    with pytest.raises(BadInput, match="serves scripted, not the recipe's 'other'"):
        verify(request)


def test_correctness_without_baseline_is_refused(servers, tmp_path):
    served, _ = servers
    request = VerifyRequest(recipe=scripted_recipe(), out_dir=tmp_path, endpoint=Endpoint(served.url))
    with pytest.raises(BadInput, match="correctness needs a baseline"):
        verify(request)


def test_cli_exit_codes_and_one_line_errors(tmp_path):
    unreachable = subprocess.run(
        [sys.executable, "-c", "from b70ctl.cli import main; main()", "verify", "--endpoint", "http://127.0.0.1:9",
         "--recipe", "cpu-tiny", "--baseline-endpoint", "http://127.0.0.1:9", "--out", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120)
    assert unreachable.returncode == 2
    lines = [line for line in unreachable.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unreachable" in lines[0], unreachable.stderr


def test_reference_of_another_recipe_is_refused_before_any_request(servers, tmp_path):
    served, baseline = servers
    from b70ctl.checks.client import VllmClient
    from b70ctl.checks.correctness import record_reference

    recipe = scripted_recipe(SHORT_RATE)
    reference = tmp_path / "ref.json"
    with VllmClient(Endpoint(baseline.url, model="scripted")) as client:
        record_reference(client, recipe, reference)
    other = recipe.model_copy(update={"name": "pr620-fp8-tp2"})
    before = len(served.requests)
    request = VerifyRequest(recipe=other, out_dir=tmp_path / "out", endpoint=Endpoint(served.url, model="scripted"),
                            reference_path=reference)
    with pytest.raises(BadInput, match="reference"):
        verify(request)
    assert len(served.requests) == before


def test_api_key_is_sent_but_never_written(servers, tmp_path):
    served, baseline = servers
    secret = "sk-test-0123456789"
    key_file = tmp_path / "key"
    key_file.write_text(secret + "\n")
    key_file.chmod(0o600)
    from b70ctl.verify.cli import read_api_key

    key = read_api_key(key_file)
    request = VerifyRequest(recipe=scripted_recipe(SHORT_RATE), out_dir=tmp_path / "out",
                            endpoint=Endpoint(served.url, model="scripted", api_key=key),
                            baseline_endpoint=Endpoint(baseline.url, model="scripted"))
    report = verify(request)
    assert report.passed
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), path
    assert secret not in repr(request.endpoint)



def test_raw_host_facts_read_under_a_root_prefix_mark_the_hardware_emulated(tmp_path):
    from b70ctl.verify.pipeline import load_host_facts
    from b70host.facts import collect_facts
    from sysfs_trees import sysfs

    root = sysfs.build("b70x2-switch", str(tmp_path / "tree"))
    emulated = tmp_path / "emulated.json"
    emulated.write_text(json.dumps(collect_facts(root)))
    assert load_host_facts(emulated).hardware_root == root
    real = tmp_path / "real.json"
    real.write_text(json.dumps({**collect_facts(root), "root": "/"}))
    assert load_host_facts(real).hardware_root is None


def test_a_run_after_one_killed_outright_names_and_clears_what_it_left(servers, tmp_path, capsys):
    """SIGKILL leaves report.json saying "running", a report's temporary file and the raw/ being cleared: the
    next run into the same directory (verify's, by its marker) names each on stderr and removes them. A file of the
    same shape outside --out, and the user's files inside it, stay."""
    served, baseline = servers
    recipe = scripted_recipe(SHORT_RATE)
    out = tmp_path / "out"
    verify(request_for(recipe, served, baseline, out))
    report = json.loads((out / "report.json").read_text())
    report.update(partial=True, partial_reason="running")
    (out / "report.json").write_text(json.dumps(report))
    temporary = out / ".report.json.k3x9_a1b.tmp"
    temporary.write_text("{half")
    stale_raw = out / ".raw-stale-4242" / "throughput" / "short"
    stale_raw.mkdir(parents=True)
    (stale_raw / "001.json").write_text("{}")
    notes = out / "notes.txt"
    notes.write_text("mine\n")
    beside = tmp_path / ".report.json.k3x9_a1b.tmp"
    beside.write_text("not in --out")
    capsys.readouterr()

    verify(request_for(recipe, served, baseline, out))

    err = capsys.readouterr().err
    assert f"warning: {out / 'report.json'} says \"running\"" in err
    assert f"warning: removing {temporary}, left by an earlier run that was killed" in err
    assert f"warning: removing {out / '.raw-stale-4242'}" in err
    assert not temporary.exists() and not (out / ".raw-stale-4242").exists()
    assert notes.read_text() == "mine\n" and beside.read_text() == "not in --out"
    assert json.loads((out / "report.json").read_text())["partial"] is False


def test_a_user_directory_with_a_raw_folder_is_refused_before_any_request(servers, tmp_path):
    """--out . in a directory holding the user's raw/: refused, raw/ intact, no request sent."""
    served, baseline = servers
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "data.bin").write_bytes(b"\x00" * 16)
    with pytest.raises(BadInput, match=r"raw was not made by b70ctl verify \(no marker\), it would be deleted"):
        verify(request_for(scripted_recipe(SHORT_RATE), served, baseline, tmp_path))
    assert (tmp_path / "raw" / "data.bin").read_bytes() == b"\x00" * 16
    assert served.requests == [] and not (tmp_path / "report.json").exists()


def test_the_write_probe_goes_through_no_link_and_a_stale_one_is_no_obstacle(servers, tmp_path):
    """--out/.write-test planted as a link to a file outside: refused, the file untouched. A regular .write-test
    (a run killed between making and removing it) is removed and the run goes on."""
    served, baseline = servers
    outside = tmp_path / "victim.txt"
    outside.write_text("not verify's\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".write-test").symlink_to(outside)
    with pytest.raises(BadInput, match=r"\.write-test is a link verify did not create: remove it"):
        verify(request_for(scripted_recipe(SHORT_RATE), served, baseline, out))
    assert outside.read_text() == "not verify's\n" and (out / ".write-test").is_symlink()
    (out / ".write-test").unlink()
    (out / ".write-test").write_text("")
    verify(request_for(scripted_recipe(SHORT_RATE), served, baseline, out))
    assert not (out / ".write-test").exists() and (out / "report.json").exists()
