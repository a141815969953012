"""The smoke check: is the endpoint up, serving the recipe's model, and answering every kind of request verify uses?

Each sub-check runs on its own and fails with its reason; one failing does not stop the others, so the report
shows everything that is wrong at once. The one-token prompt is sent as a single token id: that is the case that
crashes the ESIMD decode kernel of BF16 target-only XPU images (docs/facts.md, Known failures), which a text prompt
could silently tokenize past.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from b70ctl.checks.client import EndpointError, VllmClient
from b70ctl.checks.metrics import MetricsUnavailable, missing_generation_tokens, parse_metrics, snapshot
from b70ctl.recipes.model import Recipe
from b70ctl.report.model import SmokeResult, SubCheck

SMOKE_PROMPT = "The server"
SMOKE_MAX_TOKENS = 8
ONE_TOKEN_SEED_TEXT = "Hello"


class SubCheckFailed(Exception):
    def __init__(self, reason: str, detail: dict[str, Any] | None = None):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail or {}


def run_smoke(client: VllmClient, recipe: Recipe) -> SmokeResult:
    checks = [
        _run("health", lambda: _health(client)),
        _run("models", lambda: _models(client, recipe)),
        _run("completion", lambda: _completion(client, "completions", SMOKE_PROMPT)),
        _run("chat_completion", lambda: _completion(client, "chat", SMOKE_PROMPT)),
        _run("one_token_prompt", lambda: _one_token_prompt(client)),
        _run("stream_done", lambda: _stream_done(client)),
        _run("metrics", lambda: _metrics(client, recipe)),
        _run("speculation", lambda: served_speculation(client, recipe)),
    ]
    return SmokeResult(passed=all(check.passed for check in checks), checks=checks)


def _run(name: str, check: Callable[[], dict[str, Any]]) -> SubCheck:
    try:
        return SubCheck(name=name, passed=True, detail=check())
    except SubCheckFailed as failed:
        return SubCheck(name=name, passed=False, reason=failed.reason, detail=failed.detail)
    except EndpointError as error:
        return SubCheck(name=name, passed=False, reason=error.reason)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
        # The server answered 200 with a body that is not the OpenAI shape.
        return SubCheck(name=name, passed=False, reason=f"unexpected answer shape: {error.__class__.__name__}: "
                                                        f"{error}")


def _health(client: VllmClient) -> dict[str, Any]:
    response = client.get("/health")
    if response.status_code != 200:
        raise SubCheckFailed(f"GET /health: HTTP {response.status_code}")
    return {"status_code": 200}


def _models(client: VllmClient, recipe: Recipe) -> dict[str, Any]:
    expected = client.endpoint.model or recipe.serve.served_model_name
    served = client.models()
    if expected not in served:
        raise SubCheckFailed(f"/v1/models lists {served}, not {expected!r}: wrong endpoint, or pass the served "
                             "model name", {"served": served, "expected": expected})
    return {"served": served}


def _generated_tokens(answer: dict[str, Any]) -> tuple[int, str]:
    choice = answer["choices"][0]
    if "message" in choice:
        text = choice["message"].get("content") or ""
    else:
        text = choice.get("text") or ""
    token_ids = choice.get("token_ids")
    usage_tokens = (answer.get("usage") or {}).get("completion_tokens")
    count = len(token_ids) if token_ids is not None else usage_tokens
    if not count:
        raise SubCheckFailed("the answer carries no generated tokens", {"answer": str(answer)[:300]})
    return int(count), text


def _completion(client: VllmClient, api: str, prompt: str) -> dict[str, Any]:
    answer = client.complete(api, prompt, SMOKE_MAX_TOKENS, temperature=0.0)  # type: ignore[arg-type]
    count, text = _generated_tokens(answer)
    return {"completion_tokens": count, "text": text[:200]}


def _one_token_prompt(client: VllmClient) -> dict[str, Any]:
    seed_ids = client.tokenize(ONE_TOKEN_SEED_TEXT)
    if not seed_ids:
        raise SubCheckFailed(f"the tokenizer turned {ONE_TOKEN_SEED_TEXT!r} into no tokens")
    prompt = seed_ids[:1]
    answer = client.complete("completions", prompt, SMOKE_MAX_TOKENS, temperature=0.0)
    count, text = _generated_tokens(answer)
    prompt_tokens = (answer.get("usage") or {}).get("prompt_tokens")
    if prompt_tokens is not None and prompt_tokens != 1:
        raise SubCheckFailed(f"sent one prompt token, the server counted {prompt_tokens}",
                             {"prompt_token_ids": prompt})
    return {"prompt_token_ids": prompt, "completion_tokens": count, "text": text[:200]}


def _stream_done(client: VllmClient) -> dict[str, Any]:
    stream = client.stream("completions", SMOKE_PROMPT, SMOKE_MAX_TOKENS, temperature=0.0)
    detail = {"chunks": len(stream.chunks), "tokens": len(stream.token_ids), "done": stream.done}
    if stream.error is not None:
        raise SubCheckFailed(stream.error, detail)
    if not stream.token_ids:
        raise SubCheckFailed("the stream ended with [DONE] but carried no token ids", detail)
    return detail


def _metrics(client: VllmClient, recipe: Recipe) -> dict[str, Any]:
    try:
        snapshot = parse_metrics(client.metrics_text(), client.endpoint.model or recipe.serve.served_model_name)
    except MetricsUnavailable as unavailable:
        raise SubCheckFailed(unavailable.reason) from unavailable
    if snapshot.generation_tokens is None:
        raise SubCheckFailed(missing_generation_tokens(snapshot))
    if snapshot.non_finite:
        raise SubCheckFailed(f"/metrics gives {', '.join(snapshot.non_finite)} as NaN or infinite: those counters "
                             "are unusable")
    if recipe.serve.speculative is not None and not snapshot.has_spec_decode:
        raise SubCheckFailed(f"the recipe speculates ({recipe.serve.speculative.method}) but /metrics has no "
                             "vllm:spec_decode_* counters: the server runs without speculation")
    return {"generation_tokens": snapshot.generation_tokens, "spec_decode": snapshot.has_spec_decode}


SPECULATION_PROBE_TOKENS = 16


def served_speculation(client: VllmClient, recipe: Recipe) -> dict[str, Any]:
    """What the server speculates, from its own counters, against what the recipe says it should: one request
    between two /metrics reads must draft exactly when the recipe speculates, and the per-position acceptance
    series must number the recipe's k (vLLM exports positions 0..k-1). A report then never prints the recipe's
    speculative method for a server that runs another configuration."""
    model = client.endpoint.model or recipe.serve.served_model_name
    try:
        before = snapshot(client, model)
        client.complete("completions", SMOKE_PROMPT, SPECULATION_PROBE_TOKENS, temperature=0.0)
        after = snapshot(client, model)
    except MetricsUnavailable as unavailable:
        raise SubCheckFailed(unavailable.reason) from unavailable
    drafts = (after.num_drafts or 0.0) - (before.num_drafts or 0.0)
    positions = after.speculative_positions
    detail: dict[str, Any] = {"drafts": drafts, "speculative_positions": positions}
    spec = recipe.serve.speculative
    if spec is None:
        if drafts > 0 or positions:
            raise SubCheckFailed(f"the recipe serves without speculation but the server drafted ({drafts:g} drafts, "
                                 f"{positions} draft positions): it runs another configuration", detail)
        return detail
    if drafts <= 0:
        raise SubCheckFailed(f"the recipe speculates ({spec.method}, k={spec.num_speculative_tokens}) but the server "
                             "made no draft for a request: it runs without speculation", detail)
    if positions != spec.num_speculative_tokens:
        raise SubCheckFailed(f"the server drafts {positions} tokens per step (per-position counters), the recipe "
                             f"k={spec.num_speculative_tokens}: it runs another speculative configuration", detail)
    return detail
