"""`b70ctl lock status`: is a recipe's lock resolved, and if not, what resolves it and what network that needs.

site.yml's preflight runs it for each recipe of the play before anything changes: an unresolved lock stops the
run (naming the command and the network) unless the inventory opts in (preflight_allow_unresolved_lock), and
then the run says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from b70ctl.lock.model import Lock
from b70ctl.lock.registry import parse_reference
from b70ctl.lock.resolve import hub_endpoint
from b70ctl.lock.vendor import NETWORK_NEEDED
from b70ctl.recipes import Recipe


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


def lock_status(recipe: Recipe, lock: Lock, path: Path, recipe_argument: str, allow_unresolved: bool) -> dict[str, Any]:
    """One JSON document: resolved or not, each unresolved part with its reason and network, the command that
    resolves it, and whether a run may go on (ok)."""
    unresolved = [{"part": part, "reason": getattr(lock, part).unresolved_reason or "not resolved",
                   "network": network_for(part, recipe)} for part in lock.unresolved_fields()]
    command = f"b70ctl lock resolve --recipe {recipe_argument}"
    if not unresolved:
        message = f"lock {path} for {recipe.name} is resolved"
    else:
        parts = ", ".join(item["part"] for item in unresolved)
        networks = "; ".join(dict.fromkeys(item["network"] for item in unresolved))
        message = (f"lock {path} for {recipe.name} is NOT resolved ({parts}: no revision, digest or hash pinned): "
                   f"run `{command}` on the controller where it can reach {networks}, then commit the lock")
        if allow_unresolved:
            message += ("; going on because preflight_allow_unresolved_lock is true: nothing unpinned is fetched, "
                        "so the stages that need those pins fail until it is resolved")
    return {"recipe": recipe.name, "lock": str(path), "resolved": not unresolved, "unresolved": unresolved,
            "resolve_command": None if not unresolved else command, "allowed_unresolved": allow_unresolved,
            "ok": not unresolved or allow_unresolved, "message": message}
