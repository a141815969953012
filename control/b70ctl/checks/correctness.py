"""Greedy correctness: does the served (speculative) endpoint produce what the target alone produces?

Every prompt of the recipe's correctness set is generated at temperature 0 on the served endpoint and on a
baseline (a target-only endpoint, or a reference file recorded from one), and the outputs are compared by TOKEN
IDS: two different token sequences can decode to the same text, and text hides the position where they part.
Greedy "lossless" speculation is algorithmic, not bit-exact (docs/facts.md, Measuring): this check reports
identical/total and where each mismatch starts; whether that fraction is good enough is a claim of the recipe,
judged with the other claims.

A guard against silent garbage runs on the served outputs as well, because several real images served garbage
while answering every request with HTTP 200: empty outputs, degenerate repetition, and the recipe's probes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from b70ctl.checks.client import EndpointError, VllmClient
from b70ctl.documents import Document as _Strict
from b70ctl.errors import BadInput, first_problem
from b70ctl.files import read_json_object, require_replaceable, write_json_atomically
from b70ctl.recipes.model import CorrectnessSettings, Probe, Recipe
from b70ctl.report.model import CorrectnessResult, GarbageFinding, PromptComparison

REFERENCE_SCHEMA_VERSION: Final = 1
# Tokens of context shown on each side of a divergence: enough to read the sentence, short enough for a report.
CONTEXT_TOKENS = 8
# A tail counts as degenerate only when its n-gram repeats at least this often: two equal tokens in a row are
# ordinary text ("1 1", "!!"), a loop is not.
DEGENERATE_MIN_REPEATS = 3


# -- the reference file ------------------------------------------------------------------------------------------
class ReferenceOutput(_Strict):
    """The target-only greedy output of one prompt."""

    prompt: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


class Reference(_Strict):
    """Greedy outputs of a target-only server for one recipe's correctness prompts (one JSON document)."""

    schema_version: Literal[1] = REFERENCE_SCHEMA_VERSION
    recipe: str
    served_model: str
    max_tokens: int = Field(ge=1)
    prompts: list[str] = Field(min_length=1)
    outputs: list[ReferenceOutput]
    created_at: datetime
    vllm_version: str | None = Field(None, description="What the recording server's /version reported")

    _source: str | None = PrivateAttr(None)  # the file it was loaded from, for the report

    @model_validator(mode="after")
    def _one_output_per_prompt(self) -> Reference:
        if [output.prompt for output in self.outputs] != self.prompts:
            raise ValueError("outputs must hold one output per prompt, in the order of prompts")
        return self

    def describe(self) -> str:
        where = self._source or "reference"
        version = self.vllm_version or "unknown"
        return (f"reference {where} (recipe {self.recipe}, model {self.served_model}, vLLM {version}, "
                f"recorded {self.created_at.isoformat(timespec='seconds')})")


def _rerecord_hint(recipe: Recipe, path: Path) -> str:
    return (f"re-record it from a target-only server with "
            f"`b70ctl verify --endpoint URL --recipe {recipe.name} --record-reference {path}`")


def server_vllm_version(client: VllmClient) -> str | None:
    """The version vLLM reports on /version; None when the server does not say (not every build serves it)."""
    try:
        response = client.get("/version")
    except EndpointError:
        return None
    if response.status_code != 200:
        return None
    try:
        version = response.json().get("version")
    except (json.JSONDecodeError, AttributeError):
        return None
    return str(version) if version else None


def record_reference(client: VllmClient, recipe: Recipe, path: Path) -> Reference:
    """Generate the recipe's correctness prompts greedily on `client` (meant to be a target-only server) and
    write them to `path` atomically. A server failing on any prompt is BadInput (exit 2) and nothing is written:
    half a reference would compare only some prompts without saying so."""
    settings = recipe.correctness
    outputs = []
    for index, prompt in enumerate(settings.prompts):
        try:
            output = greedy_output(client, prompt, settings.max_tokens)
        except EndpointError as error:
            raise BadInput(f"cannot record reference {path}: {client.endpoint.base_url} failed on prompt {index}: "
                           f"{error.reason}; nothing written: fix the server and record again") from error
        outputs.append(ReferenceOutput(prompt=prompt, token_ids=output.token_ids, text=output.text,
                                       finish_reason=output.finish_reason))
    try:
        served_model = client.model
    except EndpointError as error:
        raise BadInput(f"cannot record reference {path}: {error.reason}") from error
    reference = Reference(recipe=recipe.name, served_model=served_model, max_tokens=settings.max_tokens,
                          prompts=list(settings.prompts), outputs=outputs, created_at=datetime.now(UTC),
                          vllm_version=server_vllm_version(client))
    path = Path(path)
    require_replaceable(path, "--record-reference")  # again: it may have changed while the prompts ran
    try:
        write_json_atomically(path, reference.model_dump(mode="json"))
    except OSError as error:
        raise BadInput(f"cannot write reference file {path}: {error.strerror}: choose a writable path") from error
    reference._source = str(path)
    return reference


def load_reference(path: Path, recipe: Recipe) -> Reference:
    """Read a reference file and refuse (BadInput) one that cannot be compared with `recipe`'s prompts."""
    path = Path(path)
    hint = _rerecord_hint(recipe, path)
    data = read_json_object(path, f"reference file {path}", hint)
    version = data.get("schema_version")
    if version != REFERENCE_SCHEMA_VERSION:
        raise BadInput(f"reference file {path}: field schema_version is {version!r}, this b70ctl reads "
                       f"{REFERENCE_SCHEMA_VERSION}: {hint}")
    try:
        reference = Reference.model_validate(data)
    except ValidationError as error:
        raise BadInput(f"reference file {path}: field {first_problem(error)}: {hint}") from error
    reference._source = str(path)
    check_reference_matches(reference, recipe)
    return reference


def check_reference_matches(reference: Reference, recipe: Recipe) -> None:
    """Refuse (BadInput) a reference whose outputs answer other questions than `recipe`'s correctness set."""
    path = Path(reference._source or "FILE")
    where = f"reference file {path}"
    hint = _rerecord_hint(recipe, path)
    settings = recipe.correctness
    if reference.recipe != recipe.name:
        raise BadInput(f"{where}: field recipe is {reference.recipe!r} but this run verifies recipe "
                       f"{recipe.name!r}: {hint}")
    if reference.prompts != list(settings.prompts):
        index = first_divergence(reference.prompts, list(settings.prompts))
        raise BadInput(f"{where}: field prompts differs from recipe {recipe.name}'s correctness.prompts "
                       f"(first at prompt {index}): {hint}")
    if reference.max_tokens != settings.max_tokens:
        raise BadInput(f"{where}: field max_tokens is {reference.max_tokens} but recipe {recipe.name} asks for "
                       f"{settings.max_tokens}: {hint}")


# -- generating ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GreedyOutput:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    answer: dict[str, Any]  # the server's whole JSON answer, kept in raw/


def greedy_output(client: VllmClient, prompt: str, max_tokens: int) -> GreedyOutput:
    """One non-streamed completion at temperature 0 (sent explicitly), with the generated token ids."""
    answer = client.complete("completions", prompt, max_tokens, temperature=0.0)
    where = "POST /v1/completions"
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        found = "no choices" if not choices else f"choices as a JSON {type(choices).__name__}, not a list"
        raise EndpointError(f"{where}: the answer has {found}: not vLLM's completion", 200)
    choice = choices[0]
    if not isinstance(choice, dict):
        raise EndpointError(f"{where}: the first choice is a JSON {type(choice).__name__}, not an object: not "
                            "vLLM's completion", 200)
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise EndpointError(f"{where}: the answer has no token_ids (the server ignores return_token_ids: vLLM >= "
                            "0.10.2 is needed to compare by token ids)", 200)
    # Integers as JSON has them: a 3.7 is no token id, and rounding it would make two different answers compare
    # equal (a bool is an int to Python, never to JSON).
    if not isinstance(token_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
        raise EndpointError(f"{where}: token_ids is not a list of integers: not vLLM's completion", 200)
    text, finish_reason = choice.get("text"), choice.get("finish_reason")
    if not isinstance(text, str | None) or not isinstance(finish_reason, str | None):
        raise EndpointError(f"{where}: the choice's text or finish_reason is not a string: not vLLM's completion",
                            200)
    return GreedyOutput(token_ids=list(token_ids), text=text or "", finish_reason=finish_reason, answer=answer)


# -- pure arithmetic -----------------------------------------------------------------------------------------
def first_divergence(expected: Sequence[object], actual: Sequence[object]) -> int | None:
    """Index of the first token where the two outputs differ; when one is a prefix of the other, the length of
    the shorter one; None when they are identical."""
    for index, (left, right) in enumerate(zip(expected, actual, strict=False)):
        if left != right:
            return index
    if len(expected) != len(actual):
        return min(len(expected), len(actual))
    return None


def context_bounds(length: int, position: int, tokens_each_side: int = CONTEXT_TOKENS) -> tuple[int, int]:
    """[start, end) of the tokens shown around `position` in an output of `length` tokens: up to
    `tokens_each_side` before it, the diverging token itself and up to `tokens_each_side` after it."""
    start = max(0, position - tokens_each_side)
    end = min(length, position + 1 + tokens_each_side)
    return start, max(start, end)


def divergence_context(token_ids: Sequence[int], position: int, decode: Callable[[list[int]], str],
                       tokens_each_side: int = CONTEXT_TOKENS) -> str:
    """The text around `position`, the diverging token in [[ ]]; an output that ended there shows [[<end>]]."""
    start, end = context_bounds(len(token_ids), position, tokens_each_side)
    before = decode(list(token_ids[start:position])) if position > start else ""
    if position < len(token_ids):
        diverging = decode([token_ids[position]])
        after = decode(list(token_ids[position + 1:end])) if end > position + 1 else ""
    else:
        diverging, after = "<end>", ""
    lead = "…" if start > 0 else ""
    tail = "…" if end < len(token_ids) else ""
    return f"{lead}{before}[[{diverging}]]{after}{tail}"


@dataclass(frozen=True)
class Repetition:
    period_tokens: int  # length of the repeated n-gram
    tail_tokens: int  # how many tokens at the end follow that period
    fraction: float  # tail_tokens / all tokens


def degenerate_repetition(token_ids: Sequence[int], max_period: int, min_fraction: float,
                          min_repeats: int = DEGENERATE_MIN_REPEATS) -> Repetition | None:
    """The output's tail is one n-gram (period <= max_period) repeated over >= min_fraction of all tokens.

    For each period p the periodic tail is the longest suffix where token[i] == token[i+p]. A counting sequence
    "1, 2, 3" never has a long one (a digit changes every period); a model stuck on one token or a short phrase
    does. Returns the longest such tail, or None."""
    count = len(token_ids)
    best: Repetition | None = None
    for period in range(1, max_period + 1):
        if count < period * min_repeats:
            break
        index = count - period - 1
        while index >= 0 and token_ids[index] == token_ids[index + period]:
            index -= 1
        tail = count - (index + 1)
        if tail < period * min_repeats:
            continue
        fraction = tail / count
        if fraction >= min_fraction and (best is None or tail > best.tail_tokens):
            best = Repetition(period_tokens=period, tail_tokens=tail, fraction=fraction)
    return best


def probe_match(text: str, expect_any: Sequence[str]) -> str | None:
    """The first expected substring found in the answer (case-sensitive, as the recipe writes them)."""
    for expected in expect_any:
        if expected in text:
            return expected
    return None


def garbage_findings(prompt: str, token_ids: Sequence[int], text: str,
                     settings: CorrectnessSettings) -> list[GarbageFinding]:
    """What is wrong with one served output, if anything: empty, or degenerate repetition."""
    if not token_ids or not text.strip():
        what = "no tokens" if not token_ids else f"{len(token_ids)} tokens of whitespace only"
        return [GarbageFinding(prompt=prompt, kind="empty", detail=f"the output is empty ({what})")]
    loop = degenerate_repetition(token_ids, settings.degenerate_max_period, settings.degenerate_min_fraction)
    if loop is None:
        return []
    start = len(token_ids) - loop.tail_tokens
    ngram = list(token_ids[start:start + loop.period_tokens])
    return [GarbageFinding(
        prompt=prompt, kind="degenerate_repetition",
        detail=(f"the last {loop.tail_tokens} of {len(token_ids)} tokens ({loop.fraction:.0%}) repeat the "
                f"{loop.period_tokens}-token n-gram {ngram}: {_clip(text[-60:])!r}"),
    )]


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


# -- the check -----------------------------------------------------------------------------------------------
def run_correctness(client: VllmClient, recipe: Recipe, baseline: VllmClient | Reference,
                    raw_dir: Path) -> CorrectnessResult:
    """Compare the served endpoint's greedy outputs with the baseline's, token id by token id, and look for
    garbage. Never raises for the endpoints: a failure mid-way keeps what was compared and says why in
    `reason`. Raw answers go to raw_dir/correctness/."""
    settings = recipe.correctness
    if isinstance(baseline, Reference):
        check_reference_matches(baseline, recipe)
    out_dir = Path(raw_dir) / "correctness"
    out_dir.mkdir(parents=True, exist_ok=True)
    baseline_name = baseline.describe() if isinstance(baseline, Reference) else baseline.endpoint.base_url
    comparisons: list[PromptComparison] = []
    garbage: list[GarbageFinding] = []
    reason: str | None = None
    served_failed = False

    for index, prompt in enumerate(settings.prompts):
        try:
            served = greedy_output(client, prompt, settings.max_tokens)
        except EndpointError as error:
            reason = f"served endpoint failed on prompt {index}: {error.reason}"
            served_failed = True
            break
        garbage += garbage_findings(prompt, served.token_ids, served.text, settings)
        try:
            expected_ids, expected_raw = _baseline_output(baseline, index, prompt, settings.max_tokens)
        except EndpointError as error:
            _write_raw(out_dir / f"prompt-{index:02d}.json", prompt, served.answer, None, baseline_name)
            reason = f"baseline endpoint failed on prompt {index}: {error.reason}"
            break
        _write_raw(out_dir / f"prompt-{index:02d}.json", prompt, served.answer, expected_raw, baseline_name)
        comparisons.append(_compare(client, prompt, expected_ids, served.token_ids))

    if not served_failed:
        for index, probe in enumerate(settings.probes):
            try:
                garbage += _run_probe(client, probe, out_dir / f"probe-{index:02d}.json")
            except EndpointError as error:
                reason = _join(reason, f"served endpoint failed on probe {index}: {error.reason}")
                break

    total = len(comparisons)
    if reason is not None:
        reason = f"compared {total} of {len(settings.prompts)} prompts; {reason}"
    identical = sum(1 for comparison in comparisons if comparison.identical)
    return CorrectnessResult(
        passed=reason is None and not garbage,
        baseline=baseline_name,
        identical=identical,
        total=total,
        identical_fraction=identical / total if total else 0.0,
        comparisons=comparisons,
        garbage=garbage,
        reason=reason,
    )


def _join(first: str | None, second: str) -> str:
    return second if first is None else f"{first}; {second}"


def _baseline_output(baseline: VllmClient | Reference, index: int, prompt: str,
                     max_tokens: int) -> tuple[list[int], dict[str, Any]]:
    if isinstance(baseline, Reference):
        output = baseline.outputs[index]
        return list(output.token_ids), output.model_dump(mode="json")
    expected = greedy_output(baseline, prompt, max_tokens)
    return expected.token_ids, expected.answer


def _compare(client: VllmClient, prompt: str, expected: list[int], actual: list[int]) -> PromptComparison:
    position = first_divergence(expected, actual)
    comparison = PromptComparison(
        prompt=prompt, identical=position is None, tokens_compared=max(len(expected), len(actual)),
        first_divergence=position, expected_token_ids=expected, actual_token_ids=actual,
    )
    if position is not None:
        # The served endpoint's tokenizer decodes both sides: the baseline may be a file, and comparing by
        # token ids presumes one tokenizer anyway.
        decode = _decoder(client)
        comparison.expected_context = divergence_context(expected, position, decode)
        comparison.actual_context = divergence_context(actual, position, decode)
    return comparison


def _decoder(client: VllmClient) -> Callable[[list[int]], str]:
    def decode(token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        try:
            return client.detokenize(token_ids)
        except EndpointError:
            return f"<token ids {token_ids}>"  # still auditable when /detokenize is unavailable

    return decode


def _run_probe(client: VllmClient, probe: Probe, raw_path: Path) -> list[GarbageFinding]:
    output = greedy_output(client, probe.prompt, probe.max_tokens)
    matched = probe_match(output.text, probe.expect_any)
    write_json_atomically(raw_path, {"prompt": probe.prompt, "expect_any": probe.expect_any,
                                     "matched": matched, "served": output.answer})
    if matched is not None:
        return []
    return [GarbageFinding(prompt=probe.prompt, kind="probe_failed",
                           detail=f"expected any of {probe.expect_any} in the answer, got {_clip(output.text)!r}")]


def _write_raw(path: Path, prompt: str, served: dict[str, Any], baseline: dict[str, Any] | None,
               baseline_name: str) -> None:
    write_json_atomically(path, {"prompt": prompt, "served": served, "baseline": baseline,
                                 "baseline_source": baseline_name})


