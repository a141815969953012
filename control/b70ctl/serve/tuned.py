"""A host's tune applied on the next serving run: `b70ctl serve render --tuned` takes the host's vllm_serve_tuned
(host_vars/<host>/b70_tuned.yml) and renders the recipe with its overrides, as the tune served the winner
(candidate_command): recipe knobs into the validated recipe, oneCCL thresholds into the environment.

The overrides change the rendered argv and environment, so they change /etc/b70/serve.json and the unit: the serve
stage's generation, and so the configuration the host's report measured, changes, and it is measured again. The
appliance hash stays the hash of the recipe and its lock (a drift field across the fleet); the report's serve
command shows what was applied.

The document is serve's to read and the tune's to write (tune/render.py tuned_yaml), so it lives here, below the tune.
"""

from __future__ import annotations

import json
from datetime import date as date_type
from typing import Literal

from pydantic import Field, ValidationError

from b70ctl.documents import Document
from b70ctl.errors import BadInput, first_problem
from b70ctl.files import parse_json
from b70ctl.recipes.model import Recipe

# A tuned knob's value: None leaves vLLM's default.
Value = int | str | None

RETUNE = "run playbooks/tune.yml for this host again, or delete its host_vars/<host>/b70_tuned.yml"


def ccl_env(overrides: dict[str, Value]) -> dict[str, str]:
    """The oneCCL variables among the overrides: host environment on top of the profile's, not recipe fields."""
    return {name: str(value) for name, value in overrides.items() if name.startswith("CCL_") and value is not None}


class TunedSettings(Document):
    """A host's applied tune: `vllm_serve_tuned` in host_vars/<host>/b70_tuned.yml, which roles/vllm_serve hands to
    `b70ctl serve render --tuned`. Written by `b70ctl tune` (render.py tuned_yaml)."""

    recipe: str = Field(description="The recipe tuned; the overrides are refused for any other")
    outcome: Literal["tuned", "default_best", "no_candidate"]
    overrides: dict[str, Value] = Field(default_factory=dict, description="Empty when the default stays")
    profile: str | None = Field(None, description="The oneCCL profile the thresholds were tuned for")
    score_tok_s: float | None = None
    default_score_tok_s: float | None = None
    budget_requests: int = Field(ge=0)
    spent_requests: int = Field(ge=0)
    date: date_type


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """json.loads keeps the last of a key given twice; a tuned file with two values for one knob is refused."""
    names = [name for name, _ in pairs]
    for name in names:
        if names.count(name) > 1:
            raise BadInput(f"--tuned (vllm_serve_tuned, b70_tuned.yml): key {name!r} is given twice: {RETUNE}")
    return dict(pairs)


def parse_tuned(text: str) -> TunedSettings | None:
    """The --tuned JSON: the host's vllm_serve_tuned, or {} for a host never tuned (None)."""
    try:
        document = parse_json(text, "--tuned", "pass the host's vllm_serve_tuned as JSON",
                              object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise BadInput(f"--tuned is not JSON ({error.msg}): pass the host's vllm_serve_tuned as JSON") from None
    if document in ({}, None):
        return None
    try:
        return TunedSettings.model_validate(document)
    except ValidationError as error:
        raise BadInput(f"--tuned (vllm_serve_tuned, b70_tuned.yml): {first_problem(error)}: {RETUNE}") from error


def apply_tuned(recipe: Recipe, tuned: TunedSettings | None, profile: str | None) -> tuple[Recipe, dict[str, str]]:
    """The recipe with the host's tuned overrides, and the oneCCL environment they add. Refused (BadInput) when
    the tune was of another recipe, or its thresholds were tuned for another oneCCL profile than the host's now."""
    if tuned is None or not tuned.overrides:
        return recipe, {}
    if tuned.recipe != recipe.name:
        raise BadInput(f"b70_tuned.yml tunes recipe {tuned.recipe}, the host serves {recipe.name}: {RETUNE}")
    host_env = ccl_env(tuned.overrides)
    if host_env and tuned.profile is not None and profile != tuned.profile:
        raise BadInput(f"b70_tuned.yml's oneCCL thresholds were tuned for profile {tuned.profile}, the host's "
                       f"profile is now {profile}: {RETUNE}")
    try:
        return recipe.with_overrides(tuned.overrides), host_env
    except (ValueError, ValidationError) as error:
        reason = first_problem(error) if isinstance(error, ValidationError) else str(error)
        raise BadInput(f"b70_tuned.yml's overrides do not apply to recipe {recipe.name}: {reason}: {RETUNE}") \
            from error


def probe_passed(tuned: TunedSettings | None) -> bool:
    """Whether the host's tune is the record that the gate's prefix-cache probe passed there: its winner was served
    with prefix caching on (the tune renders such a candidate with the cache on) and passed the gate, the probe
    included, at its first serve and the same tokens at every later one."""
    return tuned is not None and tuned.outcome == "tuned" and tuned.overrides.get("prefix_caching") == "on"
