"""A host's tune applied on the next serving run: `b70ctl serve render --tuned` takes the host's vllm_serve_tuned
(host_vars/<host>/b70_tuned.yml) and renders the recipe with its overrides, as the tune served the winner
(candidate_command): recipe knobs into the validated recipe, oneCCL thresholds into the environment.

The overrides change the rendered argv and environment, so they change /etc/b70/serve.json and the unit: the serve
stage's generation, and so the configuration the host's report measured, changes, and it is measured again. The
appliance hash stays the hash of the recipe and its lock (a drift field across the fleet); the report's serve
command shows what was applied.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from b70ctl.errors import BadInput, first_problem
from b70ctl.files import parse_json
from b70ctl.recipes.model import Recipe
from b70ctl.tune.model import Candidate, TunedSettings

RETUNE = "run playbooks/tune.yml for this host again, or delete its host_vars/<host>/b70_tuned.yml"


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
    candidate = Candidate(overrides=tuned.overrides)
    if candidate.host_env and tuned.profile is not None and profile != tuned.profile:
        raise BadInput(f"b70_tuned.yml's oneCCL thresholds were tuned for profile {tuned.profile}, the host's "
                       f"profile is now {profile}: {RETUNE}")
    try:
        return recipe.with_overrides(tuned.overrides), candidate.host_env
    except (ValueError, ValidationError) as error:
        reason = first_problem(error) if isinstance(error, ValidationError) else str(error)
        raise BadInput(f"b70_tuned.yml's overrides do not apply to recipe {recipe.name}: {reason}: {RETUNE}") \
            from error
