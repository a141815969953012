"""The gate against silent garbage (checks/gate.py) against real HTTP servers on 127.0.0.1 speaking vLLM's slice of
the API: one that answers consistently, one that corrupts only answers whose prompt prefix it has seen before (a
prefix-cache corruption), one whose answers change after a restart, and one that answers `!!!!`."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from b70ctl.checks.client import Endpoint, VllmClient
from b70ctl.checks.correctness import Reference, ReferenceOutput, record_reference
from b70ctl.checks.gate import (
    NOT_OWNED,
    cite_correctness,
    compare_after_restart,
    load_answers,
    replay,
    run_gate,
    save_answers,
)
from b70ctl.escaping import markdown_code
from b70ctl.recipes import load_recipe
from b70ctl.recipes.model import CorrectnessSettings, Recipe
from b70ctl.report.html import render_html
from b70ctl.report.load import load_report
from b70ctl.report.markdown import render_markdown
from b70ctl.report.measurements import gate_measurements
from b70ctl.report.model import CorrectnessResult, GateResult, PromptComparison
from b70ctl.verify.pipeline import VerifyRequest, verify
from hostile import LoopbackServer, QuietHandler

CORRUPT_AT = 5  # the generated token a cache-corrupting server changes
RESTART_AT = 3  # the generated token a restarted server answers differently
BANG = 0  # Qwen's "!": what NaN logits decode to
HOSTILE_PIECE = "<b>|`"  # a decoded piece holding markup: text in every report, never markup


def tokenize(text: str) -> list[int]:
    """One token per character, as ScriptedServer does."""
    return [1000 + ord(character) % 500 for character in text]


def answer_ids(prompt_ids: list[int], max_tokens: int) -> list[int]:
    """A greedy answer that depends on the whole prompt, never one token twice in a row."""
    seed = zlib.crc32(json.dumps(prompt_ids).encode())
    return [10 + (seed * 31 + index * 17) % 400 for index in range(max_tokens)]


class GateServer(LoopbackServer):
    """vLLM's /v1/models, /tokenize, /detokenize and /v1/completions. `corrupt_seen_prefix`: an answer to a prompt of
    more than 1024 tokens whose first 16 tokens it has seen before has token CORRUPT_AT changed (by one); `generation`
    above 0: token RESTART_AT is 999, as a server whose answers change after a restart; `bang`: every answer is
    `!!!!`; `knows_canary`: the code canary is answered 14."""

    def __init__(self, model: str, *, corrupt_seen_prefix: bool = False, generation: int = 0, bang: bool = False,
                 knows_canary: bool = False, tokenize: bool = True, detokenize: bool = True) -> None:
        super().__init__(_Handler)
        self.httpd.gate = self  # type: ignore[attr-defined]
        self.model = model
        self.corrupt_seen_prefix, self.generation, self.bang = corrupt_seen_prefix, generation, bang
        self.knows_canary, self.can_tokenize, self.can_detokenize = knows_canary, tokenize, detokenize
        self.seen: set[tuple[int, ...]] = set()
        self.completions: list[dict[str, Any]] = []

    def __enter__(self) -> GateServer:
        super().__enter__()
        return self

    def answer(self, prompt: str | list[int], max_tokens: int) -> tuple[list[int], str]:
        ids = prompt if isinstance(prompt, list) else tokenize(prompt)
        if self.bang:
            return [BANG] * max_tokens, "!" * max_tokens
        if self.knows_canary and prompt == ">>> sum(i*i for i in range(4))\n":
            return [14, 201], "14\n"
        tokens = answer_ids(ids, max_tokens)
        prefix = tuple(ids[:16])
        if self.corrupt_seen_prefix and len(ids) > 1024 and prefix in self.seen and max_tokens > CORRUPT_AT:
            tokens[CORRUPT_AT] += 1
        self.seen.add(prefix)
        if self.generation and max_tokens > RESTART_AT:
            tokens[RESTART_AT] = 999
        return tokens, decode(tokens)


def decode(tokens: list[int]) -> str:
    return "".join("!" if token == BANG else f"t{token} " for token in tokens)


class _Handler(QuietHandler):

    def do_GET(self) -> None:  # noqa: N802 BaseHTTPRequestHandler's name
        gate: GateServer = self.server.gate  # type: ignore[attr-defined]
        if self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": gate.model, "object": "model"}]})
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802 BaseHTTPRequestHandler's name
        gate: GateServer = self.server.gate  # type: ignore[attr-defined]
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if body.get("model") != gate.model:
            self.send_json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
        elif self.path == "/tokenize" and gate.can_tokenize:
            self.send_json(200, {"tokens": tokenize(body["prompt"]), "count": len(body["prompt"])})
        elif self.path == "/detokenize" and gate.can_detokenize:
            self.send_json(200, {"prompt": decode(body["tokens"])})
        elif self.path == "/v1/completions":
            assert body["temperature"] == 0.0 and body["return_token_ids"] is True
            gate.completions.append(body)
            tokens, text = gate.answer(body["prompt"], body["max_tokens"])
            choice = {"index": 0, "text": text, "token_ids": tokens, "finish_reason": "length"}
            self.send_json(200, {"choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": len(tokens)}})
        else:
            self.send_json(404, {"detail": "Not Found"})


def tiny() -> Recipe:
    """cpu-tiny: a generated target (the canary is asked, not judged), max_model_len 2048."""
    return load_recipe("cpu-tiny")


def real() -> Recipe:
    """A real checkpoint's recipe (the canary is judged), max_model_len 8192."""
    return load_recipe("pr620-fp8-tp2")


@contextmanager
def served(recipe: Recipe, **behaviour: Any) -> Iterator[tuple[GateServer, VllmClient]]:
    with GateServer(recipe.serve.served_model_name, **behaviour) as server, \
            VllmClient(Endpoint(server.url, model=recipe.serve.served_model_name, timeout_s=10)) as client:
        yield server, client


def check(result: GateResult, name: str):
    return next(found for found in result.checks if found.name == name)


def long_prompts(server: GateServer) -> list[list[int]]:
    return [body["prompt"] for body in server.completions if isinstance(body["prompt"], list)]


# -- (1) a server that answers consistently ------------------------------------------------------------------------
def test_a_consistent_server_passes_and_the_long_prompt_fills_the_tiny_recipes_context(tmp_path: Path) -> None:
    recipe = tiny()
    with served(recipe) as (server, client):
        result = run_gate(client, recipe, tmp_path)
    assert result.passed, result.checks
    assert [(c.name, c.passed) for c in result.checks] == [
        ("repetition", True), ("prefix_cache", True), ("code_canary", None), ("single_token_run", True),
        ("restart", None)]
    assert check(result, "restart").detail == NOT_OWNED
    assert "not judged: the recipe's target is a generated tiny model" in check(result, "code_canary").detail
    # max_model_len 2048 minus 48 generated and 16 spare: 1984 prompt tokens, three times (one cold), and the result
    # says it is short of 2048
    prompts = long_prompts(server)
    assert [len(prompt) for prompt in prompts] == [1984, 1984, 1984] and prompts[0] == prompts[1] == prompts[2]
    assert "1984 tokens (the server's /tokenize)" in check(result, "prefix_cache").detail
    assert "short of 2048" in check(result, "prefix_cache").detail
    # a few requests: 2 prompts x 3, the long prompt 3 times, the canary
    assert len(server.completions) == 10
    assert [body["prompt"] for body in server.completions[:3]] == [recipe.correctness.prompts[0]] * 3
    saved = load_answers(tmp_path / "gate" / "answers.json")
    assert [answer.name for answer in saved.answers] == ["repetition-0", "repetition-1", "prefix-cache", "canary"]
    assert gate_measurements(result) == {"gate.passed": 1.0, "gate.repetition.passed": 1.0,
                                         "gate.prefix_cache.passed": 1.0, "gate.single_token_run.passed": 1.0}


def test_a_real_recipe_goes_past_2048_tokens_and_judges_the_canary(tmp_path: Path) -> None:
    recipe = real()
    with served(recipe, knows_canary=True) as (server, client):
        result = run_gate(client, recipe, tmp_path)
    assert result.passed, result.checks
    assert [len(prompt) for prompt in long_prompts(server)] == [2304] * 3
    assert "short of" not in check(result, "prefix_cache").detail
    assert check(result, "code_canary").passed is True
    with served(recipe, knows_canary=False) as (server, client):
        wrong = run_gate(client, recipe, None)
    assert not wrong.passed
    canary = check(wrong, "code_canary")
    assert canary.passed is False and "expected any of ['14']" in canary.detail


def test_without_tokenize_the_long_prompt_is_counted_in_characters_and_fits(tmp_path: Path) -> None:
    recipe = tiny()
    with served(recipe, tokenize=False) as (server, client):
        result = run_gate(client, recipe, tmp_path)
    assert result.passed, result.checks
    texts = [body["prompt"] for body in server.completions if body["prompt"].startswith("Run ")]
    # one token per character at most: 2048 - 48 generated - 16 spare
    assert [len(text) for text in texts] == [1984] * 3
    assert "estimated from characters" in check(result, "prefix_cache").detail


# -- (2) a prefix-cache corruption ---------------------------------------------------------------------------------
def test_a_server_corrupting_answers_to_a_cached_prefix_fails_at_the_position_with_both_tokens(tmp_path: Path) -> None:
    recipe = tiny()
    with served(recipe, corrupt_seen_prefix=True) as (server, client):
        result = run_gate(client, recipe, tmp_path)
    cold = answer_ids(long_prompts(server)[0], recipe.correctness.max_tokens)
    assert not result.passed
    assert check(result, "repetition").passed is True  # short prompts are answered right from the cache
    probe = check(result, "prefix_cache")
    assert probe.passed is False
    found = probe.first_difference
    assert found is not None
    assert (found.position, found.expected_token, found.got_token) == (CORRUPT_AT, cold[CORRUPT_AT],
                                                                       cold[CORRUPT_AT] + 1)
    assert found.prompt == "<1984 prompt token ids>"
    assert found.expected_text is not None and f"[[t{cold[CORRUPT_AT]} ]]" in found.expected_text
    assert found.got_text is not None and f"[[t{cold[CORRUPT_AT] + 1} ]]" in found.got_text
    assert f"first difference at generated token {CORRUPT_AT}" in probe.detail
    assert gate_measurements(result)["gate.passed"] == 0.0


def test_without_detokenize_a_difference_still_names_the_tokens(tmp_path: Path) -> None:
    recipe = tiny()
    with served(recipe, corrupt_seen_prefix=True, detokenize=False) as (_, client):
        found = check(run_gate(client, recipe, tmp_path), "prefix_cache").first_difference
    assert found is not None and found.position == CORRUPT_AT
    assert found.expected_text is None and found.got_text is None
    assert found.got_token == found.expected_token + 1  # type: ignore[operator]


# -- (3) answers that change after a restart -----------------------------------------------------------------------
def test_answers_that_change_after_a_restart_fail_naming_the_position(tmp_path: Path) -> None:
    recipe = tiny()
    with served(recipe) as (_, first), served(recipe, generation=1) as (_, restarted), \
            served(recipe) as (_, same):
        changed = run_gate(first, recipe, tmp_path, restart=lambda: restarted)
        earlier = changed.answers
        assert earlier is not None
        kept = compare_after_restart(earlier, replay(same, earlier))
    restart = check(changed, "restart")
    assert not changed.passed and restart.passed is False
    cold = earlier.answers[0]
    found = restart.first_difference
    assert found is not None and found.prompt == cold.prompt
    assert (found.position, found.expected_token, found.got_token) == (RESTART_AT, cold.token_ids[RESTART_AT], 999)
    assert kept.passed is True and "4 prompt(s)" in kept.detail


def test_a_later_serve_compares_with_saved_answers(tmp_path: Path) -> None:
    """What a caller that serves a candidate several times does: keep one serve's answers, ask the next serve with
    the same nonce, compare."""
    recipe = tiny()
    with served(recipe) as (_, first):
        save_answers(run_gate(first, recipe, None).answers, tmp_path / "answers.json")  # type: ignore[arg-type]
    earlier = load_answers(tmp_path / "answers.json")
    with served(recipe, generation=1) as (server, later):
        result = run_gate(later, recipe, None, earlier=earlier)
    assert long_prompts(server)[0] == earlier.answers[2].prompt  # the same long prompt: the nonce was reused
    restart = check(result, "restart")
    assert restart.passed is False and restart.first_difference is not None
    assert restart.first_difference.position == RESTART_AT and restart.first_difference.got_token == 999


# -- (4) a degenerate `!!!!` run -----------------------------------------------------------------------------------
def test_a_run_of_one_token_fails(tmp_path: Path) -> None:
    recipe = real()
    with served(recipe, bang=True) as (_, client):
        result = run_gate(client, recipe, tmp_path)
    assert not result.passed
    assert check(result, "repetition").passed is True  # the same garbage every time: identity alone cannot see it
    run = check(result, "single_token_run")
    assert run.passed is False
    assert f"are token {BANG} ('!') over and over" in run.detail and "no target-only answer" in run.detail
    assert check(result, "code_canary").passed is False


def test_a_run_the_target_alone_answers_too_is_not_the_servers_garbage(tmp_path: Path) -> None:
    recipe = tiny()
    with served(recipe, bang=True) as (_, client), served(recipe, bang=True) as (_, baseline):
        excused = run_gate(client, recipe, tmp_path, baseline=baseline)
    with served(recipe, bang=True) as (_, client), served(recipe) as (_, baseline):
        failed = run_gate(client, recipe, tmp_path, baseline=baseline)
    assert check(excused, "single_token_run").passed is True
    assert "which the target-only baseline answers the same way" in check(excused, "single_token_run").detail
    assert check(failed, "single_token_run").passed is False
    assert "the target-only baseline does not answer so" in check(failed, "single_token_run").detail


def test_a_reference_excuses_a_run_on_its_own_prompts(tmp_path: Path) -> None:
    recipe = tiny()
    settings = recipe.correctness
    reference = Reference(recipe=recipe.name, served_model="tiny-qwen3", max_tokens=settings.max_tokens,
                          prompts=list(settings.prompts), created_at=datetime.now(UTC),
                          outputs=[ReferenceOutput(prompt=prompt, token_ids=[BANG] * settings.max_tokens, text="!")
                                   for prompt in settings.prompts])
    with served(recipe, bang=True) as (_, client):
        result = run_gate(client, recipe, tmp_path, baseline=reference)
    # the reference answers the repeated prompts the same way; the long prompt is not in it
    run = check(result, "single_token_run")
    assert run.passed is False and "prefix-cache" in run.detail


# -- greedy identity: the correctness check's, cited ---------------------------------------------------------------
def _correctness(identical: int, total: int) -> CorrectnessResult:
    comparisons = [PromptComparison(prompt=f"p{index}", identical=index < identical, tokens_compared=3,
                                    first_divergence=None if index < identical else 1,
                                    expected_token_ids=[1, 2, 3], actual_token_ids=[1, 2, 3] if index < identical
                                    else [1, 7, 3]) for index in range(total)]
    return CorrectnessResult(passed=True, baseline="reference r.json", identical=identical, total=total,
                             identical_fraction=identical / total, comparisons=comparisons)


def test_greedy_identity_cites_correctness_and_the_recipes_claim() -> None:
    empty = GateResult(passed=True, checks=[])
    # cpu-tiny claims every answer identical; pr620 claims 4/5 (PR #620's own figure)
    failed = check(cite_correctness(empty, _correctness(4, 5), tiny()), "greedy_identity")
    assert failed.passed is False and failed.first_difference is not None
    assert (failed.first_difference.position, failed.first_difference.expected_token,
            failed.first_difference.got_token) == (1, 2, 7)
    assert "4/5 greedy answers token-identical with reference r.json" in failed.detail
    assert check(cite_correctness(empty, _correctness(4, 5), real()), "greedy_identity").passed is True
    assert check(cite_correctness(empty, _correctness(3, 5), real()), "greedy_identity").passed is False
    assert check(cite_correctness(empty, None, real()), "greedy_identity").passed is None
    assert not cite_correctness(empty, _correctness(4, 5), tiny()).passed


# -- in verify -----------------------------------------------------------------------------------------------------
def _verify(recipe: Recipe, tmp_path: Path, **behaviour: Any):
    with GateServer(recipe.serve.served_model_name) as target:
        reference = tmp_path / "reference.json"
        with VllmClient(Endpoint(target.url, model=recipe.serve.served_model_name)) as client:
            record_reference(client, recipe, reference)
    with GateServer(recipe.serve.served_model_name, **behaviour) as server:
        report = verify(VerifyRequest(recipe=recipe, endpoint=Endpoint(server.url, timeout_s=10),
                                      out_dir=tmp_path / "out", reference_path=reference,
                                      checks=("correctness",)))
    return report


def test_verify_runs_the_gate_with_correctness_and_a_failure_fails_the_report(tmp_path: Path) -> None:
    recipe = tiny().model_copy(update={"claims": []})
    recipe = recipe.model_copy(update={"correctness": CorrectnessSettings(prompts=recipe.correctness.prompts[:2],
                                                                          max_tokens=16)})
    good = _verify(recipe, tmp_path / "good")
    assert good.passed and good.gate is not None and good.gate.passed
    assert [c.name for c in good.gate.checks][-1] == "greedy_identity"
    assert check(good.gate, "greedy_identity").passed is True
    assert good.measurements["gate.passed"] == 1.0
    saved = json.loads((tmp_path / "good" / "out" / "report.json").read_text())
    assert saved["gate"]["passed"] is True and "answers" not in saved["gate"]
    assert (tmp_path / "good" / "out" / "raw" / "gate" / "answers.json").is_file()
    loaded = load_report(tmp_path / "good" / "out" / "report.json")  # what the fleet report reads back
    assert loaded.gate is not None and [c.name for c in loaded.gate.checks] == [c.name for c in good.gate.checks]

    bad = _verify(recipe, tmp_path / "bad", corrupt_seen_prefix=True)
    assert bad.correctness is not None and bad.correctness.passed  # the short prompts are right
    assert not bad.passed and bad.gate is not None and not bad.gate.passed
    assert bad.measurements["gate.passed"] == 0.0
    markdown = (tmp_path / "bad" / "out" / "report.md").read_text()
    assert "failed: gate (prefix_cache)" in markdown
    assert "## Gate against silent garbage" in markdown
    assert f"first difference at generated token {CORRUPT_AT}" in markdown
    html = (tmp_path / "bad" / "out" / "report.html").read_text()
    assert "Gate against silent garbage" in html and "prefix_cache" in html


def test_what_the_server_decodes_stays_text_in_both_reports(tmp_path: Path) -> None:
    recipe = tiny().model_copy(update={"claims": []})
    with served(recipe, corrupt_seen_prefix=True) as (_, client):
        result = run_gate(client, recipe, tmp_path)
    found = check(result, "prefix_cache").first_difference
    assert found is not None and found.expected_text is not None
    found.expected_text = f"…[[{HOSTILE_PIECE}]]…"
    report = _verify(recipe, tmp_path / "report").model_copy(update={"gate": result})
    html = render_html(report, recipe)
    assert HOSTILE_PIECE not in html and "[[&lt;b&gt;|`]]" in html
    markdown = render_markdown(report, recipe)
    assert markdown_code(found.expected_text) in markdown  # a code span: the pipe escaped, fenced past the backtick
