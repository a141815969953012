"""Greedy correctness: token-id comparison, divergence context, the garbage guard and the reference file.

The endpoints are VllmClients on an httpx.MockTransport that answers like vLLM's OpenAI server (completions with
`token_ids`, /detokenize, /version), so the check runs its real request and parsing code.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from b70ctl.checks.client import Endpoint, VllmClient
from b70ctl.checks.correctness import (
    REFERENCE_SCHEMA_VERSION,
    Reference,
    context_bounds,
    degenerate_repetition,
    divergence_context,
    first_divergence,
    garbage_findings,
    load_reference,
    probe_match,
    record_reference,
    run_correctness,
)
from b70ctl.errors import BadInput
from b70ctl.recipes import load_recipe
from b70ctl.recipes.model import CorrectnessSettings, Probe, Recipe
from b70ctl.report.measurements import correctness_measurements


# -- a scripted vLLM -------------------------------------------------------------------------------------------
def word(token_id: int) -> str:
    return f"w{token_id} "


class ScriptedVllm:
    """Answers /v1/completions from a prompt -> token ids table; every request body is kept for assertions.
    `fail_after` completions, it answers HTTP 500 (a server that breaks mid-way)."""

    def __init__(self, outputs: dict[str, list[int]], fail_after: int | None = None,
                 version: str | None = "0.32.0", texts: dict[str, str] | None = None):
        self.outputs = outputs
        self.texts = texts or {}
        self.fail_after = fail_after
        self.version = version
        self.completion_bodies: list[dict[str, Any]] = []
        self.detokenized: list[list[int]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny-qwen3"}]})
        if path == "/version":
            if self.version is None:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json={"version": self.version})
        body = json.loads(request.content)
        if path == "/detokenize":
            self.detokenized.append(body["tokens"])
            return httpx.Response(200, json={"prompt": "".join(word(t) for t in body["tokens"])})
        if path == "/v1/completions":
            if self.fail_after is not None and len(self.completion_bodies) >= self.fail_after:
                return httpx.Response(500, json={"error": {"message": "EngineCore died"}})
            self.completion_bodies.append(body)
            token_ids = self.outputs[body["prompt"]][: body["max_tokens"]]
            text = self.texts.get(body["prompt"], "".join(word(t) for t in token_ids))
            return httpx.Response(200, json={
                "id": "cmpl-1", "object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": text, "token_ids": token_ids,
                             "finish_reason": "length" if len(token_ids) == body["max_tokens"] else "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": len(token_ids)},
            })
        return httpx.Response(404, json={"detail": "Not Found"})


def client_for(server: ScriptedVllm, url: str = "http://served.test") -> VllmClient:
    return VllmClient(Endpoint(base_url=url, model="tiny-qwen3"), transport=httpx.MockTransport(server.handle))


def with_correctness(recipe: Recipe, **changes: Any) -> Recipe:
    settings = recipe.correctness.model_copy(update=changes)
    return recipe.model_copy(update={"correctness": settings})


@pytest.fixture
def recipe() -> Recipe:
    # Three prompts, short outputs: enough to see every path of the comparison.
    return with_correctness(load_recipe("cpu-tiny"), prompts=["p0", "p1", "p2"], max_tokens=12)


# Natural-looking outputs: no token repeats with a short period.
NATURAL = {
    "p0": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
    "p1": [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42],
    "p2": [51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62],
}


# -- pure arithmetic -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("expected", "actual", "position"), [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3, 4, 5], [1, 2, 3, 9, 5], 3),
    ([7, 2, 3], [8, 2, 3], 0),
    ([1, 2, 3], [1, 2, 3, 4], 3),  # served ran on past the baseline's end
    ([1, 2, 3, 4], [1, 2], 2),  # served stopped early
    ([], [5], 0),
    ([], [], None),
])
def test_first_divergence(expected, actual, position):
    assert first_divergence(expected, actual) == position


@pytest.mark.parametrize(("length", "position", "each_side", "bounds"), [
    (20, 10, 3, (7, 14)),
    (20, 1, 3, (0, 5)),
    (20, 19, 3, (16, 20)),
    (5, 5, 3, (2, 5)),  # divergence just past the end of this side
    (0, 0, 3, (0, 0)),
])
def test_context_bounds(length, position, each_side, bounds):
    assert context_bounds(length, position, each_side) == bounds


def decode_words(token_ids: list[int]) -> str:
    return "".join(word(t) for t in token_ids)


def test_divergence_context_marks_the_diverging_token():
    token_ids = list(range(100, 120))
    assert divergence_context(token_ids, 10, decode_words, tokens_each_side=2) == "…w108 w109 [[w110 ]]w111 w112 …"
    assert divergence_context(token_ids, 0, decode_words, tokens_each_side=2) == "[[w100 ]]w101 w102 …"
    assert divergence_context(token_ids, 19, decode_words, tokens_each_side=2) == "…w117 w118 [[w119 ]]"


def test_divergence_context_of_an_output_that_ended_there():
    assert divergence_context([1, 2, 3], 3, decode_words, tokens_each_side=2) == "…w2 w3 [[<end>]]"


def char_ids(text: str) -> list[int]:
    """A character-level tokenizer: the hardest case for counting text, since digits repeat across periods."""
    return [ord(c) for c in text]


def test_degenerate_repetition_finds_one_token_loop():
    loop = degenerate_repetition([5, 9, 4] + [7] * 45, max_period=4, min_fraction=0.6)
    assert loop is not None
    assert (loop.period_tokens, loop.tail_tokens) == (1, 45)
    assert loop.fraction == pytest.approx(45 / 48)


def test_degenerate_repetition_finds_short_ngram_loop():
    token_ids = [1, 2, 3, 4, 5] + [8, 9, 10] * 15
    loop = degenerate_repetition(token_ids, max_period=4, min_fraction=0.6)
    assert loop is not None
    assert loop.period_tokens == 3
    assert loop.tail_tokens == 45


def test_degenerate_repetition_ignores_a_loop_longer_than_the_max_period():
    token_ids = [1, 2, 3, 4, 5] * 10
    assert degenerate_repetition(token_ids, max_period=4, min_fraction=0.6) is None
    assert degenerate_repetition(token_ids, max_period=5, min_fraction=0.6).period_tokens == 5


@pytest.mark.parametrize("text", [
    ", ".join(str(n) for n in range(1, 40)),  # "1, 2, 3, ..., 39"
    " ".join(str(n) for n in range(95, 130)),  # crosses 100: digits of unequal length
    " ".join("abcdefghijklmnopqrstuvwxyz"),  # alphabet run: period 52 characters
])
def test_counting_sequences_are_not_degenerate(text):
    assert degenerate_repetition(char_ids(text), max_period=4, min_fraction=0.6) is None
    # also with one token per number, the other way tokenizers split counting text
    assert degenerate_repetition(list(range(200, 240)), max_period=4, min_fraction=0.6) is None


def test_natural_text_is_not_degenerate():
    text = "The server reads the tokens before the next step. A drafter proposes a block of drafts in one pass."
    assert degenerate_repetition(char_ids(text), max_period=4, min_fraction=0.6) is None


def test_a_short_repeated_tail_below_the_fraction_is_not_degenerate():
    # 10 looping tokens at the end of 40: 25% < 60%
    assert degenerate_repetition(list(range(30)) + [3] * 10, max_period=4, min_fraction=0.6) is None
    assert degenerate_repetition(list(range(30)) + [3] * 10, max_period=4, min_fraction=0.2).tail_tokens == 10


def test_two_equal_tokens_are_not_a_loop():
    assert degenerate_repetition([4, 4], max_period=4, min_fraction=0.6) is None
    assert degenerate_repetition([4, 4, 4], max_period=4, min_fraction=0.6).tail_tokens == 3


def test_probe_match():
    assert probe_match(" Paris is the capital.", ["Paris"]) == "Paris"
    assert probe_match(" seven days", ["7", "seven", "Seven"]) == "seven"
    assert probe_match(" London", ["Paris"]) is None
    assert probe_match(" paris", ["Paris"]) is None  # case-sensitive, as the recipe writes it


def test_garbage_findings_kinds():
    settings = CorrectnessSettings(prompts=["x"], degenerate_max_period=4, degenerate_min_fraction=0.6)
    assert [f.kind for f in garbage_findings("x", [], "", settings)] == ["empty"]
    whitespace = garbage_findings("x", [220, 220], "  ", settings)
    assert [f.kind for f in whitespace] == ["empty"]
    assert "whitespace" in whitespace[0].detail
    looping = garbage_findings("x", [1, 2] + [9] * 20, "ab" + "!" * 20, settings)
    assert [f.kind for f in looping] == ["degenerate_repetition"]
    assert "[9]" in looping[0].detail and "20 of 22" in looping[0].detail
    assert garbage_findings("x", NATURAL["p0"], "fine text", settings) == []


# -- run_correctness against endpoints -----------------------------------------------------------------------
def test_identical_outputs(recipe, tmp_path):
    served, baseline = ScriptedVllm(NATURAL), ScriptedVllm(NATURAL)
    result = run_correctness(client_for(served), recipe, client_for(baseline, "http://baseline.test"), tmp_path)
    assert (result.identical, result.total, result.identical_fraction) == (3, 3, 1.0)
    assert result.passed and result.reason is None and result.garbage == []
    assert result.baseline == "http://baseline.test"
    assert [c.first_divergence for c in result.comparisons] == [None, None, None]
    assert [c.tokens_compared for c in result.comparisons] == [12, 12, 12]
    # greedy, explicit, the recipe's length, token ids asked for, on both sides
    for body in served.completion_bodies + baseline.completion_bodies:
        assert body["temperature"] == 0.0
        assert body["max_tokens"] == 12
        assert body["return_token_ids"] is True
        assert "stream" not in body
    raw = json.loads((tmp_path / "correctness" / "prompt-01.json").read_text())
    assert raw["prompt"] == "p1"
    assert raw["served"]["choices"][0]["token_ids"] == NATURAL["p1"]
    assert raw["baseline"]["choices"][0]["token_ids"] == NATURAL["p1"]
    assert sorted(p.name for p in (tmp_path / "correctness").iterdir()) == [
        "prompt-00.json", "prompt-01.json", "prompt-02.json"]


def test_a_divergence_is_located_and_shown_in_context(recipe, tmp_path):
    diverged = dict(NATURAL, p1=NATURAL["p1"][:5] + [99, 98, 97, 96, 95, 94, 93])
    served = ScriptedVllm(diverged)
    result = run_correctness(client_for(served), recipe, client_for(ScriptedVllm(NATURAL)), tmp_path)
    assert (result.identical, result.total) == (2, 3)
    assert result.identical_fraction == pytest.approx(2 / 3)
    assert result.passed  # a mismatch is a claim's business, not garbage
    mismatch = result.comparisons[1]
    assert mismatch.identical is False
    assert mismatch.first_divergence == 5
    assert mismatch.expected_context == "w31 w32 w33 w34 w35 [[w36 ]]w37 w38 w39 w40 w41 w42 "
    assert mismatch.actual_context == "w31 w32 w33 w34 w35 [[w99 ]]w98 w97 w96 w95 w94 w93 "
    assert mismatch.expected_token_ids == NATURAL["p1"]
    assert mismatch.actual_token_ids == diverged["p1"]
    # the texts were decoded from the token ids by the served endpoint's tokenizer
    assert [36] in served.detokenized and [99] in served.detokenized


def test_an_output_cut_short_diverges_at_its_end(recipe, tmp_path):
    served = ScriptedVllm(dict(NATURAL, p2=NATURAL["p2"][:7]))
    result = run_correctness(client_for(served), recipe, client_for(ScriptedVllm(NATURAL)), tmp_path)
    comparison = result.comparisons[2]
    assert comparison.first_divergence == 7
    assert comparison.tokens_compared == 12
    assert comparison.actual_context.endswith("[[<end>]]")
    assert "[[w58 ]]" in comparison.expected_context


def test_served_endpoint_failing_midway_keeps_what_was_compared(recipe, tmp_path):
    result = run_correctness(client_for(ScriptedVllm(NATURAL, fail_after=2)), recipe,
                             client_for(ScriptedVllm(NATURAL)), tmp_path)
    assert (result.identical, result.total, result.identical_fraction) == (2, 2, 1.0)
    assert result.passed is False
    assert result.reason.startswith("compared 2 of 3 prompts; served endpoint failed on prompt 2: ")
    assert "HTTP 500" in result.reason and "EngineCore died" in result.reason


def test_baseline_endpoint_failing_midway(recipe, tmp_path):
    result = run_correctness(client_for(ScriptedVllm(NATURAL)), recipe,
                             client_for(ScriptedVllm(NATURAL, fail_after=1)), tmp_path)
    assert (result.identical, result.total) == (1, 1)
    assert result.passed is False
    assert "baseline endpoint failed on prompt 1" in result.reason
    # the served answer of the prompt the baseline failed on is still kept
    raw = json.loads((tmp_path / "correctness" / "prompt-01.json").read_text())
    assert raw["served"]["choices"][0]["token_ids"] == NATURAL["p1"] and raw["baseline"] is None


def test_unreachable_baseline(recipe, tmp_path):
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    baseline = VllmClient(Endpoint(base_url="http://down.test", model="tiny-qwen3"),
                          transport=httpx.MockTransport(refuse))
    result = run_correctness(client_for(ScriptedVllm(NATURAL)), recipe, baseline, tmp_path)
    assert result.total == 0 and result.passed is False
    assert "connection refused" in result.reason
    measurements = correctness_measurements(result)
    assert "correctness.identical_fraction" not in measurements  # not measured, rather than 0
    assert measurements["correctness.total"] == 0


def test_a_server_without_token_ids_cannot_be_compared(recipe, tmp_path):
    """An old vLLM ignores return_token_ids: comparing text instead would hide divergences, so it is a reason."""

    def no_token_ids(request: httpx.Request) -> httpx.Response:
        answer = ScriptedVllm(NATURAL).handle(request)
        if request.url.path == "/v1/completions":
            data = answer.json()
            del data["choices"][0]["token_ids"]
            return httpx.Response(200, json=data)
        return answer

    old = VllmClient(Endpoint(base_url="http://old.test", model="tiny-qwen3"),
                     transport=httpx.MockTransport(no_token_ids))
    result = run_correctness(old, recipe, client_for(ScriptedVllm(NATURAL)), tmp_path)
    assert result.total == 0 and result.passed is False
    assert "served endpoint failed on prompt 0" in result.reason and "return_token_ids" in result.reason


def test_looping_output_is_garbage_even_when_identical(recipe, tmp_path):
    looping = dict(NATURAL, p0=[11, 12] + [7] * 10)
    result = run_correctness(client_for(ScriptedVllm(looping)), recipe, client_for(ScriptedVllm(looping)), tmp_path)
    assert result.identical == 3
    assert result.passed is False and result.reason is None
    assert [(g.prompt, g.kind) for g in result.garbage] == [("p0", "degenerate_repetition")]


def test_empty_output_is_garbage(recipe, tmp_path):
    empty = dict(NATURAL, p2=[])
    result = run_correctness(client_for(ScriptedVllm(empty)), recipe, client_for(ScriptedVllm(NATURAL)), tmp_path)
    assert [(g.prompt, g.kind) for g in result.garbage] == [("p2", "empty")]
    assert result.comparisons[2].first_divergence == 0
    assert result.passed is False


def probe_recipe(recipe: Recipe) -> Recipe:
    return with_correctness(recipe, probes=[
        Probe(prompt="Question: What is the capital of France?\nAnswer:", expect_any=["Paris"]),
        Probe(prompt="Question: How many days are there in a week?\nAnswer:", expect_any=["7", "seven"]),
    ])


def test_probes_pass_and_fail(recipe, tmp_path):
    france, week = (p.prompt for p in probe_recipe(recipe).correctness.probes)
    outputs = dict(NATURAL, **{france: [1, 2, 3], week: [4, 5, 6]})
    server = ScriptedVllm(outputs, texts={france: " Paris.", week: " Blue whales."})
    result = run_correctness(client_for(server), probe_recipe(recipe), client_for(ScriptedVllm(NATURAL)), tmp_path)
    assert [(g.prompt, g.kind) for g in result.garbage] == [(week, "probe_failed")]
    assert "Blue whales" in result.garbage[0].detail
    assert result.passed is False
    probe_bodies = [b for b in server.completion_bodies if b["prompt"] in (france, week)]
    assert [b["max_tokens"] for b in probe_bodies] == [32, 32]
    assert all(b["temperature"] == 0.0 for b in probe_bodies)
    raw = json.loads((tmp_path / "correctness" / "probe-00.json").read_text())
    assert raw["matched"] == "Paris"


def test_measurements(recipe, tmp_path):
    diverged = dict(NATURAL, p1=[31, 99] + [7] * 10)
    result = run_correctness(client_for(ScriptedVllm(diverged)), recipe, client_for(ScriptedVllm(NATURAL)), tmp_path)
    assert correctness_measurements(result) == {
        "correctness.identical_fraction": pytest.approx(2 / 3),
        "correctness.identical": 2.0,
        "correctness.total": 3.0,
        "correctness.garbage_findings": 1.0,
    }


# -- the reference file ----------------------------------------------------------------------------------------
def test_reference_round_trip(recipe, tmp_path):
    path = tmp_path / "reference.json"
    recorded = record_reference(client_for(ScriptedVllm(NATURAL)), recipe, path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["reference.json"]  # no temp file left behind
    data = json.loads(path.read_text())
    assert data["schema_version"] == REFERENCE_SCHEMA_VERSION
    assert (data["recipe"], data["served_model"], data["max_tokens"]) == ("cpu-tiny", "tiny-qwen3", 12)
    assert data["vllm_version"] == "0.32.0"
    assert data["prompts"] == ["p0", "p1", "p2"]
    assert [o["token_ids"] for o in data["outputs"]] == [NATURAL["p0"], NATURAL["p1"], NATURAL["p2"]]
    assert data["outputs"][0]["text"] == decode_words(NATURAL["p0"])
    loaded = load_reference(path, recipe)
    assert loaded.model_dump() == recorded.model_dump()
    assert loaded.created_at.tzinfo is not None

    diverged = dict(NATURAL, p0=NATURAL["p0"][:3] + [90] * 9)
    result = run_correctness(client_for(ScriptedVllm(diverged)), recipe, loaded, tmp_path / "raw")
    assert (result.identical, result.total) == (2, 3)
    assert result.comparisons[0].first_divergence == 3
    assert result.baseline.startswith(f"reference {path} (recipe cpu-tiny, model tiny-qwen3, vLLM 0.32.0")
    raw = json.loads((tmp_path / "raw" / "correctness" / "prompt-00.json").read_text())
    assert raw["baseline"]["token_ids"] == NATURAL["p0"]


def test_reference_without_version_endpoint(recipe, tmp_path):
    record_reference(client_for(ScriptedVllm(NATURAL, version=None)), recipe, tmp_path / "r.json")
    assert load_reference(tmp_path / "r.json", recipe).vllm_version is None


def test_record_reference_writes_nothing_when_the_server_fails(recipe, tmp_path):
    with pytest.raises(BadInput) as refused:
        record_reference(client_for(ScriptedVllm(NATURAL, fail_after=1)), recipe, tmp_path / "r.json")
    message = str(refused.value)
    assert "\n" not in message
    assert "http://served.test failed on prompt 1: POST /v1/completions: HTTP 500: EngineCore died" in message
    assert "nothing written" in message
    assert list(tmp_path.iterdir()) == []


def test_record_reference_where_no_file_can_be_written(recipe, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(BadInput, match=r"cannot write reference file .*: choose a writable path"):
        record_reference(client_for(ScriptedVllm(NATURAL)), recipe, blocker / "r.json")


def test_record_reference_creates_its_directory(recipe, tmp_path):
    record_reference(client_for(ScriptedVllm(NATURAL)), recipe, tmp_path / "new" / "r.json")
    assert load_reference(tmp_path / "new" / "r.json", recipe).recipe == recipe.name


@pytest.fixture
def recorded(recipe, tmp_path) -> Path:
    path = tmp_path / "reference.json"
    record_reference(client_for(ScriptedVllm(NATURAL)), recipe, path)
    return path


def edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def assert_refused(path: Path, recipe: Recipe, *fragments: str) -> None:
    with pytest.raises(BadInput) as refused:
        load_reference(path, recipe)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"reference file {path}: ")
    assert f"--recipe {recipe.name} --record-reference {path}" in message  # the fix
    for fragment in fragments:
        assert fragment in message
    assert BadInput.exit_code == 2


def test_refuses_a_reference_of_another_recipe(recorded, recipe):
    other = load_recipe("pr620-fp8-tp2")
    assert_refused(recorded, other, "field recipe is 'cpu-tiny' but this run verifies recipe 'pr620-fp8-tp2'")


def test_refuses_another_prompt_set(recorded, recipe):
    assert_refused(recorded, with_correctness(recipe, prompts=["p0", "p1", "changed"]),
                   "field prompts differs", "first at prompt 2")
    assert_refused(recorded, with_correctness(recipe, prompts=["p0", "p1"]), "field prompts", "prompt 2")


def test_refuses_another_max_tokens(recorded, recipe):
    assert_refused(recorded, with_correctness(recipe, max_tokens=64), "field max_tokens is 12",
                   "asks for 64")


def test_refuses_truncated_json(recorded, recipe):
    recorded.write_text(recorded.read_text()[:200])
    assert_refused(recorded, recipe, "not valid JSON", "truncated")


def test_refuses_unknown_schema_version(recorded, recipe):
    edit_json(recorded, lambda data: data.update(schema_version=2))
    assert_refused(recorded, recipe, "field schema_version is 2", "reads 1")
    edit_json(recorded, lambda data: data.pop("schema_version"))
    assert_refused(recorded, recipe, "field schema_version is None")


def test_refuses_a_malformed_field(recorded, recipe):
    edit_json(recorded, lambda data: data["outputs"][1].update(token_ids="not ids"))
    assert_refused(recorded, recipe, "field outputs.1.token_ids")
    edit_json(recorded, lambda data: data.pop("served_model"))
    assert_refused(recorded, recipe, "field served_model: Field required")


def test_refuses_outputs_that_do_not_follow_the_prompts(recorded, recipe):
    edit_json(recorded, lambda data: data["outputs"].reverse())
    assert_refused(recorded, recipe, "one output per prompt")


def test_refuses_a_json_array_and_a_missing_file(recipe, tmp_path):
    path = tmp_path / "reference.json"
    path.write_text("[1, 2]")
    assert_refused(path, recipe, "expected a JSON object")
    assert_refused(tmp_path / "absent.json", recipe, "No such file")


def test_run_correctness_refuses_a_reference_of_another_recipe(recorded, recipe, tmp_path):
    reference = load_reference(recorded, recipe)
    other = with_correctness(recipe, prompts=["q0", "q1", "q2"])
    with pytest.raises(BadInput, match="field prompts differs"):
        run_correctness(client_for(ScriptedVllm(NATURAL)), other, reference, tmp_path)


def test_reference_model_is_one_json_document(recorded):
    reference = Reference.model_validate_json(recorded.read_text())
    assert len(reference.outputs) == len(reference.prompts) == 3


# -- captured real outputs -------------------------------------------------------------------------------------
CAPTURED = Path(__file__).parent.parent / "fixtures" / "correctness" / "captured-outputs.json"


def test_guard_on_captured_real_outputs():
    """Real vLLM CPU answers: the trained tiny model (counting, alphabet, sentences) is not garbage; the same
    architecture with random weights loops on one token for one prompt, and the guard says so."""
    captured = json.loads(CAPTURED.read_text())["outputs"]
    settings = load_recipe("cpu-tiny").correctness
    for output in captured["trained"]:
        assert garbage_findings(output["prompt"], output["token_ids"], output["text"], settings) == []
    findings = [finding for output in captured["random"]
                for finding in garbage_findings(output["prompt"], output["token_ids"], output["text"], settings)]
    assert [(f.prompt, f.kind) for f in findings] == [("10, 11, 12, 13", "degenerate_repetition")]
    assert "the last 48 of 48 tokens (100%) repeat the 1-token n-gram [291]" in findings[0].detail
