"""Spec-decode figures from real /metrics expositions captured from vLLM 0.32 CPU (tests/fixtures/metrics)."""

from __future__ import annotations

from pathlib import Path

import pytest

from b70ctl.checks.metrics import MetricsUnavailable, delta, parse_metrics, spec_decode_stats

FIXTURES = Path(__file__).parent.parent / "fixtures" / "metrics"
OUR_COMPLETION_TOKENS = 192  # three streamed requests of 64 tokens, see the fixtures' README


def load(name: str, model_name: str | None = "tiny"):
    return parse_metrics((FIXTURES / f"vllm-0.32-cpu-draft-perturbed-{name}.txt").read_text(), model_name)


def test_parse_reads_the_counters_of_a_real_exposition():
    before = load("before")
    assert before.num_drafts == 93.0
    assert before.num_draft_tokens == 372.0
    assert before.num_accepted_tokens == 372.0
    assert before.generation_tokens == 458.0
    assert before.accepted_per_position == {0: 93.0, 1: 93.0, 2: 93.0, 3: 93.0}
    assert before.has_spec_decode


def test_delta_and_spec_decode_figures():
    before, after = load("before"), load("after")
    change = delta(before, after)
    assert (change.num_drafts, change.num_draft_tokens, change.num_accepted_tokens) == (115.0, 460.0, 74.0)
    assert change.generation_tokens == 192.0
    assert change.accepted_per_position == {0: 74.0, 1: 0.0, 2: 0.0, 3: 0.0}

    stats = spec_decode_stats(before, after, OUR_COMPLETION_TOKENS)
    assert stats is not None
    assert stats.acceptance_rate == pytest.approx(74 / 460)
    assert stats.mean_acceptance_length == pytest.approx(1 + 74 / 115)
    assert stats.per_position_acceptance == pytest.approx([74 / 115, 0.0, 0.0, 0.0])
    assert stats.generation_tokens == 192.0
    assert not stats.polluted and stats.pollution_reason is None


def test_other_traffic_marks_the_counters_polluted():
    stats = spec_decode_stats(load("before"), load("after-other-traffic"), OUR_COMPLETION_TOKENS)
    assert stats is not None
    assert stats.polluted
    assert "202" in stats.pollution_reason and "192" in stats.pollution_reason
    assert "other traffic" in stats.pollution_reason


def test_fewer_counted_tokens_than_received_is_not_called_clean():
    stats = spec_decode_stats(load("before"), load("after"), OUR_COMPLETION_TOKENS + 5)
    assert stats is not None and stats.polluted
    assert "197" in stats.pollution_reason


def test_counters_going_backwards_mean_a_restart():
    stats = spec_decode_stats(load("after"), load("before"), OUR_COMPLETION_TOKENS)
    assert stats is not None and stats.polluted
    assert "restarted" in stats.pollution_reason


def test_label_sets_are_summed_and_other_models_left_out():
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="ours"} 10.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="ours"} 5.0',
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="theirs"} 100.0',
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="ours"} 40.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="ours"} 20.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="ours"} 30.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="ours"} 6.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="ours",position="0"} 9.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="ours",position="0"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="ours",position="1"} 8.0',
        "# TYPE vllm:generation_tokens_total counter",
        'vllm:generation_tokens_total{engine="0",model_name="ours"} 70.0',
        'vllm:generation_tokens_total{engine="1",model_name="ours"} 11.0',
        'vllm:generation_tokens_total{engine="0",model_name="theirs"} 999.0',
        "",
    ])
    ours = parse_metrics(text, "ours")
    assert (ours.num_drafts, ours.num_draft_tokens, ours.num_accepted_tokens) == (15.0, 60.0, 36.0)
    assert ours.generation_tokens == 81.0
    assert ours.accepted_per_position == {0: 13.0, 1: 8.0}
    # A served-name alias the labels don't know: every label set counts rather than none.
    assert parse_metrics(text, "alias").num_drafts == 115.0


def test_a_server_without_speculation_gives_no_spec_stats():
    text = '# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{engine="0",model_name="m"} 5.0\n'
    snapshot = parse_metrics(text)
    assert not snapshot.has_spec_decode
    assert snapshot.generation_tokens == 5.0
    assert spec_decode_stats(snapshot, snapshot, 0) is None


def test_unparsable_metrics_raise_a_reason():
    with pytest.raises(MetricsUnavailable, match="not a Prometheus text exposition"):
        parse_metrics("<html><body>Not Found</body></html>")
