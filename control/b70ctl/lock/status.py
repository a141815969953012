"""`b70ctl lock status`: is a recipe's lock resolved, and if not, what resolves it and what network that needs.

`b70ctl recipes check` gives site.yml's preflight the same for every recipe of the play, with each recipe validated,
before anything changes: an unresolved lock stops the run (naming the command and the network) unless the inventory
opts in (preflight_allow_unresolved_lock), and then the run says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import Field

from b70ctl.documents import Document
from b70ctl.errors import BadInput
from b70ctl.lock.model import Lock, load_recipe_and_lock
from b70ctl.lock.registry import parse_reference
from b70ctl.lock.resolve import hub_endpoint
from b70ctl.lock.vendor import NETWORK_NEEDED
from b70ctl.recipes import RECIPE_REFERENCE, Recipe


def network_for(part: str, recipe: Recipe) -> str:
    """What `lock resolve` must reach to pin PART of this recipe's lock."""
    if part in ("target", "drafter"):
        return (f"the Hugging Face hub {hub_endpoint()} over HTTPS (HF_ENDPOINT names a mirror, HF_TOKEN a gated "
                "repository)")
    if part == "image":
        image = recipe.image
        reference = image.build.base if image.source == "build" and image.build else image.reference
        return f"the container registry {parse_reference(reference).registry} over HTTPS (for {reference})"
    return f"GitHub: {NETWORK_NEEDED} (the vendor patch the series names)"


class UnresolvedPart(Document):
    part: str
    reason: str
    network: str = Field(description="What `lock resolve` must reach to pin it")


class LockStatus(Document):
    """`b70ctl lock status --json`."""

    recipe: str
    lock: str
    resolved: bool
    unresolved: list[UnresolvedPart]
    resolve_command: str | None
    allowed_unresolved: bool
    ok: bool = Field(description="Whether a run may go on: resolved, or unresolved and allowed")
    message: str


def lock_status(recipe: Recipe, lock: Lock, path: Path, recipe_argument: str, allow_unresolved: bool) -> LockStatus:
    """Resolved or not, each unresolved part with its reason and network, the command that resolves it, and whether
    a run may go on (ok)."""
    unresolved = [UnresolvedPart(part=part, reason=getattr(lock, part).unresolved_reason or "not resolved",
                                 network=network_for(part, recipe)) for part in lock.unresolved_fields()]
    command = f"b70ctl lock resolve --recipe {recipe_argument}"
    if not unresolved:
        message = f"lock {path} for {recipe.name} is resolved"
    else:
        parts = ", ".join(item.part for item in unresolved)
        networks = "; ".join(dict.fromkeys(item.network for item in unresolved))
        message = (f"lock {path} for {recipe.name} is NOT resolved ({parts}: no revision, digest or hash pinned): "
                   f"run `{command}` on the controller where it can reach {networks}, then commit the lock")
        if allow_unresolved:
            message += ("; going on because preflight_allow_unresolved_lock is true: nothing unpinned is fetched, "
                        "so the stages that need those pins fail until it is resolved")
    return LockStatus(recipe=recipe.name, lock=str(path), resolved=not unresolved, unresolved=unresolved,
                      resolve_command=None if not unresolved else command, allowed_unresolved=allow_unresolved,
                      ok=not unresolved or allow_unresolved, message=message)


class RecipeCheck(Document):
    """One recipe as a host's inventory names it (b70_recipe: a name or a file)."""

    spec: Recipe | None = Field(None, description="The recipe, validated, as `b70ctl recipes show --json` prints it")
    lock: LockStatus | None = Field(None, description="Its lock's status (as without --allow-unresolved)")
    lock_warning: str | None = Field(None, description="What a run that goes on with the unresolved lock says")
    hub_repos: list[str] = Field(default_factory=list, description="The Hub repos its target and drafter are "
                                 "downloaded from (none when generated): the token preflight asks for needs these")
    error: str | None = Field(None, description="Why the recipe or its lock cannot be read; then nothing else is set")


class RecipeChecks(Document):
    """`b70ctl recipes check --json RECIPE...`: keyed by the recipe as given."""

    recipes: dict[str, RecipeCheck]


def check_recipes(names: list[str]) -> RecipeChecks:
    """Each distinct recipe once: a recipe that cannot be used is its entry's error, so that a play fails only the
    hosts that name it."""
    checked: dict[str, RecipeCheck] = {}
    for name in dict.fromkeys(names):
        if not re.fullmatch(RECIPE_REFERENCE, name):
            checked[name] = RecipeCheck(error=f"{json.dumps(name)} holds characters it may not: a recipe name or "
                                              "file path of letters, digits and . _ / + -")
            continue
        try:
            recipe, lock, path = load_recipe_and_lock(name)
        except BadInput as error:
            checked[name] = RecipeCheck(error=str(error))
            continue
        status = lock_status(recipe, lock, path, name, allow_unresolved=False)
        warning = None if status.resolved else lock_status(recipe, lock, path, name, allow_unresolved=True).message
        hub_repos = [model.repo for model in (recipe.target, recipe.drafter) if model is not None and model.repo]
        checked[name] = RecipeCheck(spec=recipe, lock=status, lock_warning=warning, hub_repos=hub_repos)
    return RecipeChecks(recipes=checked)
