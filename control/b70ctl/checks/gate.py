"""The gate against silent garbage: answers that must not change, and garbage that must not appear.

Owners' worst fear is a server that answers every request with HTTP 200 and garbage: MTP with prefix caching on
hybrid models turned long replies to gibberish past a 2048-token block, XPU graphs with MTP k=4 and shape-alias
prefill corruption did the same (issue 40). Greedy decoding (temperature 0) is deterministic on one serve, so:

- repetition: each repetition of a prompt within a run gives the token ids of the first answer; the first request is
  cold, the later ones come from the prefix cache;
- prefix_cache: a long prompt (past one KV block and past 2048 tokens, as far as serve.max_model_len allows beside
  max_tokens; the check says when it cannot reach 2048) is answered cold, then again from the cache, compared token
  by token with the cold answer. Its first tokens are new to this run, so no earlier request cached any block of it;
- restart: the same prompts after a server restart give the same tokens. verify does not own the server, so there it
  is not run; a caller that serves a recipe more than once passes `restart`, or keeps this run's `GateAnswers` and
  compares a later serve's with `compare_after_restart`;
- greedy_identity: the target-only comparison is the correctness check's (checks/correctness.py); the gate cites it
  (`cite_correctness`) instead of asking again;
- code_canary: a REPL line with a known value (`sum(i*i for i in range(4))` is 14), judged for a real checkpoint;
  a generated tiny target answers nonsense, so there it is asked and kept, not judged;
- single_token_run: no answer is one token over and over (`!!!!`, what NaN logits decode to), unless the target-only
  baseline answers the same prompt with the same run.

A failure names the prompt, the first differing position and both tokens, decoded where the server has /detokenize.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Final, cast

from pydantic import ValidationError

from b70ctl.checks.client import EndpointError, VllmClient
from b70ctl.checks.correctness import (
    GreedyOutput,
    Reference,
    degenerate_repetition,
    divergence_context,
    first_divergence,
    greedy_output,
    probe_match,
)
from b70ctl.errors import BadInput, first_problem
from b70ctl.files import read_json_object, write_json_atomically
from b70ctl.recipes.model import Recipe
from b70ctl.report.measurements import correctness_measurements
from b70ctl.report.model import (
    CorrectnessResult,
    Difference,
    GateAnswer,
    GateAnswers,
    GateCheck,
    GateResult,
)
from b70ctl.report.verdict import judge_all

# The block the field's corruption starts past (llm-scaler 0.26.0-b2, MTP with prefix caching on hybrid models).
FIELD_BLOCK_TOKENS: Final = 2048
# Text the long prompt repeats: sentences any tokenizer splits, and the tiny target's corpus speaks (models/tiny.py).
LONG_PROMPT_SEED: Final = ("The scheduler reads the cache for each position.\nA drafter proposes a block of drafts at "
                           "full speed.\nThe kernel streams the logits in one pass.\nEach card verifies the tokens "
                           "without copying.\n")
# Context left free beside the long prompt and max_tokens: a BOS a server may add to a text prompt, and the drafted
# tokens a speculative server looks ahead by (k is at most 8 in the recipes; the spare is for a BOS and rounding).
CONTEXT_MARGIN: Final = 16
NOT_OWNED: Final = "not run: verify does not own the server (a caller that restarts it passes restart, or compares " \
                   "two serves' answers with compare_after_restart)"
PROMPT_SHOWN_CHARS: Final = 80

Restart = Callable[[], VllmClient]


class _Answered:
    """The answers of one check, and the server failure that stopped it, if any."""

    def __init__(self) -> None:
        self.answers: list[GateAnswer] = []
        self.failure: str | None = None


# -- the prompts -------------------------------------------------------------------------------------------------
def long_prompt(client: VllmClient, recipe: Recipe, nonce: str) -> tuple[str | list[int], int, str]:
    """The prefix-cache probe's prompt, its length in tokens (exact, or an upper bound) and how that was found.

    With the server's /tokenize the prompt is token ids of exactly the length asked (capped by the context less
    max_tokens and CONTEXT_MARGIN), so the server cannot re-tokenize it longer. Without it, text of as many characters
    as tokens may be sent: a byte-level tokenizer never makes more tokens than an ASCII text has characters, so it
    fits, maybe much shorter."""
    gate = recipe.correctness.gate
    max_tokens = gate.max_tokens or recipe.correctness.max_tokens
    room = recipe.serve.max_model_len - max_tokens - CONTEXT_MARGIN
    wanted = max(1, min(gate.cache_probe_tokens, room))
    marker = f"Run {nonce}.\n"
    try:
        seed_ids = client.tokenize(LONG_PROMPT_SEED)
        marker_ids = client.tokenize(marker)
    except EndpointError as error:
        chars = wanted
        text = (marker + LONG_PROMPT_SEED * (chars // len(LONG_PROMPT_SEED) + 1))[:chars]
        return text, chars, (f"{chars} characters, at most {chars} tokens (estimated from characters, so maybe short "
                             f"of {FIELD_BLOCK_TOKENS} tokens: {error.reason})")
    if not seed_ids:
        raise EndpointError("POST /tokenize: the server's tokenizer turned the long prompt's text into no tokens", 200)
    repeats = -(-max(wanted - len(marker_ids), 0) // len(seed_ids))
    ids = (marker_ids + seed_ids * repeats)[:wanted]
    return ids, len(ids), f"{len(ids)} tokens (the server's /tokenize)"


def _shown(prompt: str | list[int]) -> str:
    if isinstance(prompt, list):
        return f"<{len(prompt)} prompt token ids>"
    return prompt if len(prompt) <= PROMPT_SHOWN_CHARS else prompt[:PROMPT_SHOWN_CHARS] + "…"


def _greedy(client: VllmClient, prompt: str | list[int], max_tokens: int) -> GreedyOutput:
    # greedy_output passes the prompt to VllmClient.complete, which takes text or token ids alike.
    return greedy_output(client, cast(str, prompt), max_tokens)


def _ask(client: VllmClient, name: str, prompt: str | list[int], max_tokens: int, raw: list[dict[str, object]]
         ) -> GateAnswer:
    output = _greedy(client, prompt, max_tokens)
    raw.append({"name": name, "prompt": prompt, "served": output.answer})
    return GateAnswer(name=name, prompt=prompt, max_tokens=max_tokens, token_ids=output.token_ids, text=output.text)


# -- comparing ---------------------------------------------------------------------------------------------------
def make_decoder(client: VllmClient) -> Callable[[list[int]], str | None]:
    """Token ids to text with the server's /detokenize; None for every call once the server has none."""
    state = {"available": True}

    def decode(token_ids: list[int]) -> str | None:
        if not state["available"]:
            return None
        if not token_ids:
            return ""
        try:
            return client.detokenize(token_ids)
        except (EndpointError, KeyError, TypeError):
            state["available"] = False
            return None

    return decode


def difference(prompt: str | list[int], expected: Sequence[int], got: Sequence[int],
               decode: Callable[[list[int]], str | None] | None = None) -> Difference | None:
    """The first position where `got` parts from `expected`, with both tokens and the text around them; None when
    they are the same token ids."""
    position = first_divergence(list(expected), list(got))
    if position is None:
        return None
    expected_text = got_text = None
    if decode is not None:
        decoded = {"all": True}

        def text(ids: list[int]) -> str:
            value = decode(ids)
            if value is None:
                decoded["all"] = False
            return value or ""

        shown = divergence_context(list(expected), position, text), divergence_context(list(got), position, text)
        if decoded["all"]:
            expected_text, got_text = shown
    return Difference(prompt=_shown(prompt), position=position,
                      expected_token=expected[position] if position < len(expected) else None,
                      got_token=got[position] if position < len(got) else None,
                      expected_text=expected_text, got_text=got_text)


def describe(found: Difference) -> str:
    """One line: where two answers part and with which tokens."""
    def token(value: int | None) -> str:
        return "the end of the answer" if value is None else f"token {value}"

    line = (f"prompt {found.prompt!r}: first difference at generated token {found.position}: "
            f"{token(found.expected_token)} before, {token(found.got_token)} now")
    if found.expected_text is not None and found.got_text is not None:
        line += f" ({found.expected_text!r} vs {found.got_text!r})"
    return line


def compare_after_restart(earlier: GateAnswers, later: GateAnswers,
                          decode: Callable[[list[int]], str | None] | None = None) -> GateCheck:
    """The `restart` check: every prompt answered at both serves gave the same token ids. Prompts are matched
    exactly (a later serve replays the earlier's, see `replay`); none in common is a check that could not run."""
    later_by_prompt = {_key(answer): answer for answer in later.answers}
    compared = 0
    for answer in earlier.answers:
        again = later_by_prompt.get(_key(answer))
        if again is None or again.max_tokens != answer.max_tokens:
            continue
        compared += 1
        found = difference(answer.prompt, answer.token_ids, again.token_ids, decode)
        if found is not None:
            return GateCheck(name="restart", passed=False, first_difference=found,
                             detail=f"after a restart, {answer.name} changed: {describe(found)}")
    if not compared:
        return GateCheck(name="restart", passed=None,
                         detail="not run: the two serves answered no prompt in common (replay the earlier answers)")
    return GateCheck(name="restart", passed=True,
                     detail=f"{compared} prompt(s) gave the same token ids after a restart as before it")


def _key(answer: GateAnswer) -> tuple[str, ...] | tuple[int, ...]:
    return (answer.prompt,) if isinstance(answer.prompt, str) else tuple(answer.prompt)


def replay(client: VllmClient, earlier: GateAnswers) -> GateAnswers:
    """The earlier serve's prompts asked again, cold, on `client` (a server started since): what
    `compare_after_restart` compares. EndpointError when the server fails a request."""
    raw: list[dict[str, object]] = []
    answers = [_ask(client, answer.name, answer.prompt, answer.max_tokens, raw) for answer in earlier.answers]
    return GateAnswers(recipe=earlier.recipe, served_model=client.model, nonce=earlier.nonce,
                       recorded_at=datetime.now(UTC), answers=answers)


def save_answers(answers: GateAnswers, path: Path) -> None:
    write_json_atomically(Path(path), answers.model_dump(mode="json"))


def load_answers(path: Path) -> GateAnswers:
    """A GateAnswers file, or BadInput naming the field that is wrong."""
    fix = "give the answers.json a gate run wrote (raw/gate/answers.json)"
    data = read_json_object(Path(path), f"gate answers {path}", fix)
    try:
        return GateAnswers.model_validate(data)
    except ValidationError as error:
        raise BadInput(f"gate answers {path}: field {first_problem(error)}: {fix}") from error


# -- the checks --------------------------------------------------------------------------------------------------
def _identity(name: str, runs: list[list[GateAnswer]], decode: Callable[[list[int]], str | None], what: str,
              failure: str | None) -> GateCheck:
    """Each later answer of a run of the same prompt against its first (cold) answer."""
    for answers in runs:
        cold = answers[0] if answers else None
        for index, later in enumerate(answers[1:], start=1):
            assert cold is not None
            found = difference(cold.prompt, cold.token_ids, later.token_ids, decode)
            if found is not None:
                return GateCheck(name=name, passed=False, first_difference=found,
                                 detail=f"request {index + 1} (from the cache) differs from the cold answer: "
                                        f"{describe(found)}")
    if failure is not None:
        return GateCheck(name=name, passed=False, detail=failure)
    return GateCheck(name=name, passed=True, detail=what)


def _baseline_answer(baseline: VllmClient | Reference | None, answer: GateAnswer) -> list[int] | None:
    """The target-only baseline's answer to the same prompt, when there is one to be had."""
    if isinstance(baseline, Reference):
        if baseline.max_tokens != answer.max_tokens:
            return None
        return next((list(output.token_ids) for output in baseline.outputs if output.prompt == answer.prompt), None)
    if baseline is None:
        return None
    try:
        return _greedy(baseline, answer.prompt, answer.max_tokens).token_ids
    except EndpointError:
        return None


def _single_token_runs(answers: list[GateAnswer], min_fraction: float, baseline: VllmClient | Reference | None,
                       decode: Callable[[list[int]], str | None]) -> GateCheck:
    """No answer is one token repeated over min_fraction of it, unless the target alone answers so too."""
    excused: list[str] = []
    seen: set[tuple[object, ...]] = set()
    for answer in answers:
        if (_key(answer), tuple(answer.token_ids)) in seen:
            continue
        seen.add((_key(answer), tuple(answer.token_ids)))
        run = degenerate_repetition(answer.token_ids, 1, min_fraction)
        if run is None:
            continue
        token = answer.token_ids[-1]
        expected = _baseline_answer(baseline, answer)
        if expected is not None and degenerate_repetition(expected, 1, min_fraction) is not None \
                and expected[-1] == token:
            excused.append(answer.name)
            continue
        text = decode([token])
        shown = f" ({text!r})" if text is not None else ""
        why = ("the target-only baseline does not answer so" if expected is not None
               else "no target-only answer to compare with")
        return GateCheck(name="single_token_run", passed=False,
                         detail=f"{answer.name}, prompt {_shown(answer.prompt)!r}: the last {run.tail_tokens} of "
                                f"{len(answer.token_ids)} tokens are token {token}{shown} over and over; {why}")
    detail = f"no answer of {len(answers)} is a run of one token"
    if excused:
        detail += f" but {', '.join(excused)}, which the target-only baseline answers the same way"
    return GateCheck(name="single_token_run", passed=True, detail=detail)


def _canary_asserted(recipe: Recipe) -> bool:
    asserted = recipe.correctness.gate.assert_canary
    return recipe.target.generated is None if asserted is None else asserted


def _canary(recipe: Recipe, answered: _Answered) -> GateCheck:
    probe = recipe.correctness.gate.canary
    if answered.failure is not None or not answered.answers:
        return GateCheck(name="code_canary", passed=False, detail=answered.failure or "not answered")
    answer = answered.answers[0]
    shown = answer.text if len(answer.text) <= 60 else answer.text[:60] + "…"
    if not _canary_asserted(recipe):
        why = ("the recipe's target is a generated tiny model, whose text is nonsense"
               if recipe.correctness.gate.assert_canary is None else "the recipe's correctness.gate.assert_canary is "
                                                                      "false")
        return GateCheck(name="code_canary", passed=None,
                         detail=f"not judged: {why} (answered {shown!r}; expected {probe.expect_any} of a real "
                                "model)")
    matched = probe_match(answer.text, probe.expect_any)
    if matched is None:
        return GateCheck(name="code_canary", passed=False,
                         detail=f"prompt {_shown(probe.prompt)!r}: expected any of {probe.expect_any} in the "
                                f"answer, got {shown!r}")
    return GateCheck(name="code_canary", passed=True, detail=f"answered {matched!r} as expected")


def run_gate(client: VllmClient, recipe: Recipe, raw_dir: Path | None, restart: Restart | None = None,
             baseline: VllmClient | Reference | None = None, nonce: str | None = None,
             earlier: GateAnswers | None = None) -> GateResult:
    """The gate's checks against `client` at temperature 0. Never raises for the server: a request that fails fails
    its check, saying why. `restart` restarts the server and returns a client of the fresh one (the answers are then
    asked again there); `earlier` is an earlier serve's answers to compare this one's with (asked with its nonce).
    `baseline` excuses a run of one token the target alone answers too. Raw answers go to raw_dir/gate/."""
    settings = recipe.correctness
    gate = settings.gate
    max_tokens = gate.max_tokens or settings.max_tokens
    nonce = nonce or (earlier.nonce if earlier is not None else secrets.token_hex(4))
    decode = make_decoder(client)
    raw: list[dict[str, object]] = []

    # repetition: a few of the correctness prompts, each asked `repetitions` times
    repetition = _Answered()
    runs: list[list[GateAnswer]] = []
    for index, prompt in enumerate(settings.prompts[:gate.repetition_prompts]):
        run: list[GateAnswer] = []
        runs.append(run)
        try:
            for _ in range(gate.repetitions):
                run.append(_ask(client, f"repetition-{index}", prompt, max_tokens, raw))
        except EndpointError as error:
            repetition.failure = f"the server failed on prompt {_shown(prompt)!r}: {error.reason}"
            break
    checks = [_identity("repetition", runs, decode,
                        f"{len(runs)} prompt(s) asked {gate.repetitions} times each gave the cold answer's token ids "
                        "every time", repetition.failure)]

    # prefix_cache: one long prompt, cold, then from the cache
    probe: list[GateAnswer] = []
    probe_failure = None
    length_note = ""
    try:
        long, tokens, how = long_prompt(client, recipe, nonce)
        short = tokens <= FIELD_BLOCK_TOKENS
        length_note = (f"the long prompt: {how}" + (
            f", short of {FIELD_BLOCK_TOKENS}: the recipe's serve.max_model_len {recipe.serve.max_model_len} leaves no "
            f"more beside {max_tokens} generated tokens and {CONTEXT_MARGIN} spare"
            if short and gate.cache_probe_tokens > tokens else ""))
        for _ in range(gate.cache_probe_requests):
            probe.append(_ask(client, "prefix-cache", long, max_tokens, raw))
    except EndpointError as error:
        probe_failure = f"the server failed on the long prompt ({length_note or 'building it'}): {error.reason}"
    checks.append(_identity("prefix_cache", [probe], decode,
                            f"{length_note}: {len(probe) - 1} answer(s) from the cache gave the cold answer's token "
                            "ids", probe_failure))

    # code canary
    canary = _Answered()
    try:
        canary.answers.append(_ask(client, "canary", gate.canary.prompt, gate.canary.max_tokens, raw))
    except EndpointError as error:
        canary.failure = f"the server failed on the canary: {error.reason}"
    checks.append(_canary(recipe, canary))

    # single_token_run: every answer; the canary only where its answer means something
    answered = [answer for answers in runs for answer in answers] + probe
    answered += canary.answers if _canary_asserted(recipe) else []
    checks.append(_single_token_runs(answered, settings.degenerate_min_fraction, baseline, decode))

    try:
        served_model = client.model
    except EndpointError:
        served_model = recipe.serve.served_model_name
    cold = [answers[0] for answers in runs if answers] + probe[:1] + canary.answers
    answers = GateAnswers(recipe=recipe.name, served_model=served_model, nonce=nonce,
                          recorded_at=datetime.now(UTC), answers=cold)

    # restart
    if earlier is not None:
        checks.append(compare_after_restart(earlier, answers, decode))
    elif restart is not None:
        try:
            fresh = restart()
            checks.append(compare_after_restart(answers, replay(fresh, answers), make_decoder(fresh)))
        except EndpointError as error:
            checks.append(GateCheck(name="restart", passed=False,
                                    detail=f"the restarted server failed: {error.reason}"))
    else:
        checks.append(GateCheck(name="restart", passed=None, detail=NOT_OWNED))

    if raw_dir is not None:
        out = Path(raw_dir) / "gate"
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomically(out / "requests.json", {"requests": raw})
        save_answers(answers, out / "answers.json")
    return _result(checks, answers)


def _result(checks: list[GateCheck], answers: GateAnswers | None) -> GateResult:
    return GateResult(passed=all(check.passed is not False for check in checks), checks=checks, answers=answers)


def cite_correctness(result: GateResult, correctness: CorrectnessResult | None, recipe: Recipe) -> GateResult:
    """The gate with its greedy_identity check: the correctness check's comparison with the target-only baseline
    (recorded on that host, or given with --reference), cited rather than asked again. Greedy speculation is not
    bit-exact everywhere (docs/facts.md, Measuring): the recipe's claims on correctness.identical_fraction say how
    much must be identical; a recipe without one asks for every answer."""
    checks = [check for check in result.checks if check.name != "greedy_identity"]
    if correctness is None:
        cited = GateCheck(name="greedy_identity", passed=None, detail="not run: the correctness check did not run")
        return _result(checks + [cited], result.answers)
    differing = next((c for c in correctness.comparisons if not c.identical), None)
    found = None
    if differing is not None and differing.first_divergence is not None:
        position = differing.first_divergence
        expected, got = differing.expected_token_ids, differing.actual_token_ids
        found = Difference(prompt=_shown(differing.prompt), position=position,
                           expected_token=expected[position] if position < len(expected) else None,
                           got_token=got[position] if position < len(got) else None,
                           expected_text=differing.expected_context, got_text=differing.actual_context)
    summary = (f"correctness: {correctness.identical}/{correctness.total} greedy answers token-identical with "
               f"{correctness.baseline}")
    claims = [claim for claim in recipe.claims
              if claim.metric == "correctness.identical_fraction" and claim.divided_by is None]
    if correctness.reason is not None or not correctness.total:
        passed = False
        summary += f"; {correctness.reason or 'nothing compared'}"
    elif claims:
        verdicts = judge_all(claims, dict(correctness_measurements(correctness)))
        passed = all(verdict.verdict == "met" for verdict in verdicts)
        summary += "; " + ", ".join(f"claim {v.claim_id} ({v.bound}) {v.verdict.replace('_', ' ')}" for v in verdicts)
    else:
        passed = differing is None
    cited = GateCheck(name="greedy_identity", passed=passed, first_difference=found,
                      detail=summary + (f"; first: {describe(found)}" if found is not None else ""))
    return _result(checks + [cited], result.answers)


