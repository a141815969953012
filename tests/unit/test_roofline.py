"""The roofline: the decode rate's memory-bandwidth bound, its inputs read on the serving host, and the
efficiency each report and the fleet report show.

The model's files are transformers' and safetensors' own output (tests/fixtures/README.md, "roofline/"); the
B70's bandwidth is read from docs/facts.md; the expected bounds are computed here from those inputs, by hand."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy
import pytest
from safetensors.numpy import save_file

from b70ctl.errors import BadInput
from b70ctl.fleet.analysis import aggregate, efficiency_ranking
from b70ctl.fleet.collect import host_entry_from_report
from b70ctl.fleet.render import render_html as render_fleet_html
from b70ctl.fleet.render import render_markdown
from b70ctl.report.html import render_html
from b70ctl.report.load import LoadedReport
from b70ctl.report.markdown import render_markdown as render_report_markdown
from b70ctl.report.model import MemoryBandwidth, Report, RooflineInputs, TargetShape
from b70ctl.report.roofline import B70_BANDWIDTH_BYTES_PER_S, compute_roofline
from b70ctl.verify.pipeline import record_roofline_inputs, verify
from b70host.roofline_inputs import collect, copy_bandwidth, target_shape
from fleet_factory import environment_for, make_report, shipped_recipe
from host_package import host_module
from scripted_server import SHORT_RATE, request_for, scripted_recipe

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "roofline"


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    """The cpu-tiny target's config.json as transformers wrote it, and weights written by safetensors: an input
    embedding (16 x 8 float32), an output head (16 x 8 float32) and one float16 projection (8 x 8) in two files."""
    shutil.copy(FIXTURES / "qwen3-tiny-config.json", tmp_path / "config.json")
    save_file({"model.embed_tokens.weight": numpy.zeros((16, 8), numpy.float32),
               "lm_head.weight": numpy.ones((16, 8), numpy.float32)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"model.layers.0.self_attn.q_proj.weight": numpy.ones((8, 8), numpy.float16)},
              str(tmp_path / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    return tmp_path


def test_target_shape_reads_transformers_config_names_and_safetensors_headers(tiny_model):
    shape = TargetShape.model_validate(target_shape(str(tiny_model)))
    assert shape.weight_files == 2
    assert shape.weight_bytes == 16 * 8 * 4 + 16 * 8 * 4 + 8 * 8 * 2
    assert shape.embedding_bytes == 16 * 8 * 4 and shape.tie_word_embeddings is False
    # The captured Qwen3Config: 2 layers, both full attention, 2 KV heads of 32, float32.
    assert (shape.num_hidden_layers, shape.num_key_value_heads, shape.head_dim, shape.dtype) == (2, 2, 32, "float32")
    assert (shape.full_attention_layers, shape.sliding_attention_layers) == (2, 0)


def test_a_multimodal_config_is_read_from_its_text_config(tiny_model):
    text = json.loads((tiny_model / "config.json").read_text())
    (tiny_model / "config.json").write_text(json.dumps({"architectures": ["X"], "text_config": text}))
    shape = target_shape(str(tiny_model))
    assert (shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"]) == (2, 2, 32)


def test_what_cannot_be_read_is_said_never_guessed(tmp_path):
    shutil.copy(FIXTURES / "qwen3-tiny-config.json", tmp_path / "config.json")
    found = collect(str(tmp_path), copy_benchmark=False)
    assert "target_shape" not in found and "no *.safetensors" in found["target_shape_unavailable"]
    found = collect(None, copy_benchmark=False, models_json=str(tmp_path / "models.json"))
    assert "model store's record" in found["target_shape_unavailable"]
    (tmp_path / "models.json").write_text(json.dumps({"target": {"path": str(tmp_path)}}))
    assert "no *.safetensors" in collect(None, False, str(tmp_path / "models.json"))["target_shape_unavailable"]


def test_the_probe_as_the_role_runs_it_names_an_input_it_tripped_on_and_exits_0(tiny_model):
    """A config no transformers model would load (no attention heads, no head_dim) makes the shape a division by
    zero: the probe, run as the replication_check role runs it on a host, still prints its document, saying so
    beside what it could measure, and the report stage goes on (the role copies stdout as it is; verify reads it)."""
    config = json.loads((tiny_model / "config.json").read_text())
    config.pop("head_dim", None)
    (tiny_model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    probe = subprocess.run(host_module("roofline_inputs", "--model-dir", str(tiny_model), "--copy-benchmark"),
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    found = RooflineInputs.model_validate_json(probe.stdout)
    assert (found.target_shape, found.target_shape_unavailable) == (
        None, f"{tiny_model}: ZeroDivisionError: integer division or modulo by zero")
    assert found.memory_bandwidth is not None and found.memory_bandwidth_unavailable is None  # measured all the same


def test_copy_benchmark_counts_bytes_read_and_written():
    measured = copy_bandwidth(buffer_bytes=4 * 2**20, repeats=2)
    assert measured["buffer_bytes"] == 4 * 2**20 and measured["repeats"] == 2
    assert measured["bytes_per_s"] > 0
    assert "4 MiB" in measured["method"] and "best of 2" in measured["method"] and "written" in measured["method"]


def test_the_b70_bandwidth_is_the_one_docs_facts_gives():
    facts = (REPO / "docs" / "facts.md").read_text()
    hardware = facts.split("## Hardware", 1)[1].split("\n## ", 1)[0]
    figure = re.search(r"about (\d+) GB/s", hardware)
    assert figure is not None and float(figure.group(1)) * 1e9 == B70_BANDWIDTH_BYTES_PER_S


def _engine_timed(report: Report) -> Report:
    for workload in report.throughput.workloads:
        workload.timing_source = "engine"
    return report


def test_cpu_bound_by_hand_from_the_measured_bandwidth_and_the_tiny_target(tiny_model):
    recipe = shipped_recipe("cpu-tiny")
    report = _engine_timed(make_report(recipe, "tiny-1"))
    record_roofline_inputs(report.environment, RooflineInputs(
        memory_bandwidth=MemoryBandwidth(bytes_per_s=10e9, method="copy", buffer_bytes=1, repeats=1),
        target_shape=TargetShape.model_validate(target_shape(str(tiny_model)))))
    roofline = compute_roofline(report, recipe)

    # CPU ranks share one memory: all weights but the untied input embedding, every KV head, float32 (--dtype).
    assert roofline.memory == "host" and roofline.memory_domains == 1
    weights = 16 * 8 * 4 + 8 * 8 * 2
    kv_per_token = 2 * 2 * 32 * 4 * 2
    assert roofline.weight_bytes.value == weights and roofline.kv_bytes_per_token.value == kv_per_token
    by_name = {figures.workload: figures for figures in roofline.workloads}
    assert "acceptance_friendly_baseline" not in by_name  # the target-only server's workload
    short = by_name["short"]
    result = next(w for w in report.throughput.workloads if w.name == "short")
    context = 12 + result.max_tokens / 2  # the factory's requests: 12 prompt tokens, max_tokens generated
    length = result.spec_decode.mean_acceptance_length
    assert short.mean_context_tokens == pytest.approx(context)
    assert short.bound_tok_s == pytest.approx(10e9 / (weights + kv_per_token * context) * length)
    assert short.efficiency == pytest.approx(result.decode_tok_s.median / short.bound_tok_s)
    efficiencies = sorted(f.efficiency for f in roofline.workloads)
    assert roofline.efficiency == pytest.approx((efficiencies[1] + efficiencies[2]) / 2)  # median of four


def test_xpu_bound_per_card_from_docs_facts():
    recipe = shipped_recipe("pr620-fp8-tp2")
    report = _engine_timed(make_report(recipe, "b70-01"))
    # A 64-layer target with every fourth layer full attention (the rest linear: no per-token KV), 4 KV heads.
    shape = TargetShape(directory="/models/target", weight_files=4, weight_bytes=28_000_000_000,
                        embedding_bytes=1_300_000_000, num_hidden_layers=64, num_key_value_heads=4, head_dim=256,
                        dtype="float8_e4m3fn", full_attention_layers=16)
    report.environment.target_shape = shape
    roofline = compute_roofline(report, recipe)

    assert roofline.memory == "card" and roofline.memory_domains == 2
    assert roofline.bandwidth_bytes_per_s.value == 608e9
    assert 'docs/facts.md, "Hardware"' in roofline.bandwidth_bytes_per_s.source
    weights_per_card = (28_000_000_000 - 1_300_000_000) / 2
    kv_per_token_per_card = 2 * (4 // 2) * 256 * 2 * 16  # bfloat16: the recipe's --dtype, no --kv-cache-dtype
    assert roofline.weight_bytes.value == weights_per_card
    assert roofline.kv_bytes_per_token.value == kv_per_token_per_card
    result = next(w for w in report.throughput.workloads if w.name == "acceptance_friendly")
    figures = next(f for f in roofline.workloads if f.workload == "acceptance_friendly")
    context = 12 + result.max_tokens / 2
    assert figures.bound_tok_s == pytest.approx(
        608e9 / (weights_per_card + kv_per_token_per_card * context) * result.spec_decode.mean_acceptance_length)


def test_one_card_is_read_per_card_with_the_recipes_fp8_kv_cache():
    recipe = shipped_recipe("dspark-int4-tp1")  # TP=1, --kv-cache-dtype fp8
    report = _engine_timed(make_report(recipe, "b70-09"))
    report.environment.target_shape = TargetShape(
        directory="/models/target", weight_files=1, weight_bytes=15_000_000_000, num_hidden_layers=64,
        num_key_value_heads=4, head_dim=256, dtype="bfloat16", full_attention_layers=16)
    report.roofline = compute_roofline(report, recipe)
    assert report.roofline.memory == "card" and report.roofline.memory_domains == 1
    assert report.roofline.kv_bytes_per_token.value == 2 * 4 * 256 * 1 * 16
    assert "kv_cache_dtype fp8" in report.roofline.kv_bytes_per_token.source
    assert "| memory bandwidth (per card) | 608.0 GB/s |" in render_report_markdown(report, recipe)


def test_another_gpu_or_a_missing_input_is_not_measured_with_the_reason():
    recipe = shipped_recipe("pr620-fp8-tp2")
    report = _engine_timed(make_report(recipe, "b60-01", environment=environment_for(
        "b60-01", gpu_model="2x Arc Pro B60")))
    roofline = compute_roofline(report, recipe)
    assert roofline.bandwidth_bytes_per_s.value is None and "B60" in roofline.bandwidth_bytes_per_s.source
    assert roofline.efficiency is None and all(f.bound_tok_s is None for f in roofline.workloads)
    assert "B60" in roofline.not_measured

    cpu = shipped_recipe("cpu-tiny")
    report = _engine_timed(make_report(cpu, "tiny-2"))
    report.environment.target_shape_unavailable = "/opt/models/target: no *.safetensors weight files"
    roofline = compute_roofline(report, cpu)
    assert roofline.efficiency is None and "no *.safetensors" in roofline.not_measured
    markdown = render_report_markdown(report.model_copy(update={"roofline": roofline}), cpu)
    headline = next(line for line in markdown.splitlines() if line.startswith("**Not measured: "))
    assert "memory bandwidth was not recorded" in headline
    # The reason comes from outside (a model directory): its Markdown characters are escaped, never emphasis.
    assert "; /opt/models/target: no \\*.safetensors weight files.**" in headline


def test_client_timed_rates_get_a_bound_but_no_efficiency(tiny_model):
    recipe = shipped_recipe("cpu-tiny")
    report = make_report(recipe, "tiny-3")  # the factory's requests are the client's
    report.environment.memory_bandwidth = MemoryBandwidth(bytes_per_s=10e9, method="copy", buffer_bytes=1, repeats=1)
    report.environment.target_shape = TargetShape.model_validate(target_shape(str(tiny_model)))
    roofline = compute_roofline(report, recipe)
    assert all(f.bound_tok_s is not None and f.efficiency is None for f in roofline.workloads)
    assert all("engine's clock" in f.not_measured for f in roofline.workloads)


def test_report_md_and_html_show_bound_measured_efficiency_and_sources(tiny_model):
    recipe = shipped_recipe("cpu-tiny")
    report = _engine_timed(make_report(recipe, "tiny-4"))
    report.environment.memory_bandwidth = MemoryBandwidth(bytes_per_s=12.5e9, method="one thread copies <x>",
                                                          buffer_bytes=1, repeats=1)
    report.environment.target_shape = TargetShape.model_validate(target_shape(str(tiny_model)))
    report.roofline = compute_roofline(report, recipe)
    short = next(f for f in report.roofline.workloads if f.workload == "short")
    markdown = render_report_markdown(report, recipe)
    assert "## Roofline: decode rate against the memory-bandwidth bound" in markdown
    assert ("| memory bandwidth (host memory) | 12.5 GB/s | measured on the serving machine: one thread copies"
            in markdown)
    assert f"| short | {short.mean_context_tokens:.0f} | {short.mean_acceptance_length:.2f} |" in markdown
    assert f"| {short.bound_tok_s:.1f} | {short.measured_tok_s:.1f} | " in markdown
    assert "drafter's weights" in markdown and "upper bound" in markdown
    html = render_html(report, recipe)
    assert "Roofline: decode rate against the memory-bandwidth bound" in html
    assert f'<td class="num">{short.bound_tok_s:.1f}</td>' in html
    assert "one thread copies &lt;x&gt;" in html and "<x>" not in html


def test_fleet_ranks_hosts_by_efficiency_and_says_who_was_not_measured():
    recipe = shipped_recipe("cpu-tiny")
    entries = []
    for host, efficiency in (("tiny-a", 0.004), ("tiny-b", 0.009), ("tiny-c", None), ("tiny-d", 0.009)):
        report = make_report(recipe, host)
        if efficiency is not None:
            report.roofline = compute_roofline(report, recipe).model_copy(update={"efficiency": efficiency})
        entries.append(host_entry_from_report(host, LoadedReport(report, f"reports/{host}/report.json"), None))
    ranking = efficiency_ranking(entries)
    assert [(r.rank, r.host, r.efficiency) for r in ranking] == [
        (1, "tiny-b", 0.009), (2, "tiny-d", 0.009), (3, "tiny-a", 0.004)]
    assert "before reports had a roofline" in entries[2].roofline_not_measured


def test_fleet_md_and_html_show_the_ranking(tmp_path):
    recipe = shipped_recipe("cpu-tiny")
    reports_dir = tmp_path / "reports"
    for host, efficiency in (("tiny-a", 0.004), ("tiny-b", 0.0125), ("tiny-c", None)):
        report = make_report(recipe, host)
        if efficiency is not None:
            report.roofline = compute_roofline(report, recipe).model_copy(update={"efficiency": efficiency})
        (reports_dir / host).mkdir(parents=True)
        (reports_dir / host / "report.json").write_text(report.model_dump_json())
    fleet = aggregate(reports_dir)
    (cpu_fleet,) = fleet.recipes
    assert [r.host for r in cpu_fleet.efficiency_ranking] == ["tiny-b", "tiny-a"]
    assert cpu_fleet.hosts_without_efficiency == ["tiny-c"]
    markdown = render_markdown(fleet)
    assert "### Efficiency against each host's memory-bandwidth bound" in markdown
    assert "| 1 | tiny-b | 1.2% |\n| 2 | tiny-a | 0.40% |" in markdown
    assert "Not measured on 1 host: tiny-c" in markdown
    html = render_fleet_html(fleet)
    assert "<th>efficiency vs bandwidth bound</th>" in html and 'data-sort="0.0125">1.2%</td>' in html


def test_verify_with_model_dir_measures_this_machine_and_reports_an_efficiency(servers, tiny_model, tmp_path):
    served, baseline = servers
    recipe = scripted_recipe(SHORT_RATE)
    report = verify(request_for(recipe, served, baseline, tmp_path / "out", model_dir=tiny_model))
    assert report.environment.memory_bandwidth is not None and report.environment.memory_bandwidth.bytes_per_s > 0
    assert report.environment.target_shape.directory == str(tiny_model)
    assert report.roofline is not None and report.roofline.efficiency is not None
    assert {f.workload for f in report.roofline.workloads} == {"short", "natural"}
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk["roofline"]["efficiency"] == pytest.approx(report.roofline.efficiency)
    assert "## Roofline" in (tmp_path / "out" / "report.md").read_text()


def test_verify_records_the_hosts_roofline_inputs_and_refuses_a_wrong_file(servers, tiny_model, tmp_path):
    served, baseline = servers
    recipe = scripted_recipe(SHORT_RATE)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"memory_bandwidth": {"bytes_per_s": -1}}))
    with pytest.raises(BadInput, match=r"roofline inputs .*wrong.json: memory_bandwidth"):
        verify(request_for(recipe, served, baseline, tmp_path / "refused", roofline_inputs_path=wrong))
    assert not (tmp_path / "refused" / "report.json").exists()

    probe = tmp_path / "roofline_inputs.json"  # as the replication_check role keeps it
    probe.write_text(json.dumps(collect(None, copy_benchmark=False, models_json=str(tmp_path / "none.json"))))
    report = verify(request_for(recipe, served, baseline, tmp_path / "out", roofline_inputs_path=probe))
    assert report.environment.target_shape is None
    assert "model store's record" in report.environment.target_shape_unavailable
    assert "model store's record" in report.roofline.not_measured
