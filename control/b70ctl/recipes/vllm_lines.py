"""What the vLLM release a recipe pins accepts: the speculative methods, the draft sampling and whether Model Runner V1
still exists, per release line (vllm_lines.yaml, each entry read from that release's own source). A recipe that asks
for something its pinned vLLM does not have is refused when it is read, with vLLM's own words, instead of at the
server's start on a host. A line the file does not list is not checked here: nothing is known against it."""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict

from b70ctl.versions import parse


class VllmLine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    wheel: str
    speculative_methods: list[str]
    draft_sample_methods: list[str]
    model_runner_v1: bool


class VllmLines(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int
    lines: dict[str, VllmLine]


@cache
def load_lines() -> VllmLines:
    text = (resources.files("b70ctl.recipes") / "vllm_lines.yaml").read_text()
    return VllmLines.model_validate(yaml.safe_load(text))


def release_line(version: str) -> str:
    """"0.21" for 0.21.0, 0.21.1.dev0 or 0.21.0rc1."""
    major, minor = (parse(version).release + (0, 0))[:2]
    return f"{major}.{minor}"


def line_refusal(vllm_version: str, method: str | None, draft_sample_method: str | None,
                 env: dict[str, str]) -> str | None:
    """Why the pinned vLLM would refuse this serving setup, or None (also for a line vllm_lines.yaml does not
    list)."""
    line = load_lines().lines.get(release_line(vllm_version))
    if line is None:
        return None
    where = f"vLLM {vllm_version} ({line.wheel}, vllm/config/speculative.py)"
    if method is not None and method not in line.speculative_methods:
        return f"speculative method {method!r} is not one of {where} SpeculativeMethod: pin a vLLM that has it"
    if draft_sample_method is not None and draft_sample_method not in line.draft_sample_methods:
        return (f"draft_sample_method {draft_sample_method!r} is not one of {where} DraftSampleMethod "
                f"({' | '.join(line.draft_sample_methods)})")
    runner = env.get("VLLM_USE_V2_MODEL_RUNNER")
    if not line.model_runner_v1 and runner is not None and runner != "1":
        # vllm/platforms/interface.py Platform.validate_environ, from 0.34: the server refuses to start.
        return (f"VLLM_USE_V2_MODEL_RUNNER={runner} is no longer supported by vLLM {vllm_version}: Model Runner V1 "
                "has been removed. Remove it from serve.env")
    return None
