"""Greedy correctness against real vLLM CPU: every speculative server answers what the target alone answers.

Uses the session's real servers (conftest): the baseline (no speculation), draft-exact, draft-perturbed and
ngram. Greedy "lossless" speculation is algorithmic (docs/facts.md, Measuring); on vLLM CPU with float32 the tiny
model's outputs are measured identical token for token, which is what these tests hold the check to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from b70ctl.checks.client import VllmClient
from b70ctl.checks.correctness import load_reference, record_reference, run_correctness
from b70ctl.errors import BadInput
from b70ctl.recipes import load_recipe

SPECULATIVE = ["draft-exact", "draft-perturbed", "ngram"]


@pytest.mark.parametrize("variant", SPECULATIVE)
def test_greedy_output_identical_to_baseline(endpoints, cpu_tiny, variant, tmp_path):
    with VllmClient(endpoints[variant]) as served, VllmClient(endpoints["baseline"]) as baseline:
        result = run_correctness(served, cpu_tiny, baseline, tmp_path)
    prompts = cpu_tiny.correctness.prompts
    assert result.reason is None
    assert result.garbage == [], result.garbage  # the trained tiny model writes text, not loops
    mismatches = [(c.prompt, c.first_divergence, c.expected_context, c.actual_context)
                  for c in result.comparisons if not c.identical]
    assert mismatches == []
    assert (result.identical, result.total, result.identical_fraction) == (len(prompts), len(prompts), 1.0)
    assert result.passed
    assert result.baseline == endpoints["baseline"].base_url
    for index, comparison in enumerate(result.comparisons):
        # real outputs, the recipe's length (the tiny model does not stop early on these prompts)
        assert len(comparison.actual_token_ids) == cpu_tiny.correctness.max_tokens
        raw = json.loads((tmp_path / "correctness" / f"prompt-{index:02d}.json").read_text())
        assert raw["served"]["choices"][0]["token_ids"] == comparison.actual_token_ids
        assert raw["baseline"]["choices"][0]["token_ids"] == comparison.expected_token_ids


def test_reference_record_and_verify_round_trip(endpoints, cpu_tiny, tmp_path):
    path = tmp_path / "reference.json"
    with VllmClient(endpoints["baseline"]) as baseline:
        recorded = record_reference(baseline, cpu_tiny, path)
        reported_version = baseline.get("/version").json()["version"]
    assert recorded.vllm_version == reported_version
    assert recorded.served_model == cpu_tiny.serve.served_model_name
    reference = load_reference(path, cpu_tiny)
    assert reference.model_dump() == recorded.model_dump()
    assert all(len(output.token_ids) == cpu_tiny.correctness.max_tokens for output in reference.outputs)

    with VllmClient(endpoints["draft-perturbed"]) as served:
        result = run_correctness(served, cpu_tiny, reference, tmp_path / "raw")
    assert (result.identical, result.total, result.passed) == (len(reference.prompts), len(reference.prompts), True)
    assert result.baseline.startswith(f"reference {path} (recipe cpu-tiny")


def test_a_divergence_is_located_and_decoded_by_the_server(endpoints, cpu_tiny, tmp_path):
    """A reference whose third output differs at token 5 (an edited file standing in for a server that
    diverged): the check finds position 5 and shows the server's own decoding of both sides."""
    path = tmp_path / "reference.json"
    with VllmClient(endpoints["baseline"]) as baseline:
        recorded = record_reference(baseline, cpu_tiny, path)
    data = json.loads(path.read_text())
    original = data["outputs"][2]["token_ids"]
    replacement = next(token for token in range(300, 400) if token != original[5])
    data["outputs"][2]["token_ids"] = original[:5] + [replacement] + original[6:]
    path.write_text(json.dumps(data))

    with VllmClient(endpoints["ngram"]) as served:
        result = run_correctness(served, cpu_tiny, load_reference(path, cpu_tiny), tmp_path / "raw")
        replacement_text = served.detokenize([replacement])
    assert (result.identical, result.total) == (len(data["prompts"]) - 1, len(data["prompts"]))
    comparison = result.comparisons[2]
    assert comparison.identical is False and comparison.first_divergence == 5
    served_text = recorded.outputs[2].text
    actual = comparison.actual_context.replace("[[", "").replace("]]", "").rstrip("…")
    assert served_text.startswith(actual), (served_text, comparison.actual_context)
    assert f"[[{replacement_text}]]" in comparison.expected_context
    assert result.passed  # a mismatch is for the claims to judge; nothing here is garbage


def test_a_reference_of_one_recipe_is_refused_for_another(endpoints, cpu_tiny, tmp_path):
    path = tmp_path / "reference.json"
    with VllmClient(endpoints["baseline"]) as baseline:
        record_reference(baseline, cpu_tiny, path)
    with pytest.raises(BadInput, match="field recipe is 'cpu-tiny' but this run verifies recipe 'pr620-fp8-tp2'"):
        load_reference(path, load_recipe("pr620-fp8-tp2"))
    # same prompts, another recipe name: still another recipe
    renamed = cpu_tiny.model_copy(update={"name": "cpu-tiny-fp16"})
    with pytest.raises(BadInput, match="--recipe cpu-tiny-fp16 --record-reference"):
        load_reference(path, renamed)
    assert load_reference(Path(path), cpu_tiny).recipe == "cpu-tiny"
