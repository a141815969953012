"""The rehearsal overlay (rehearsal.yaml beside this file): what a rehearsal serves differently from a B70 host.

A rehearsal starts a recipe's own units on a systemd test host whose cards are emulated, from the recipe's own
image built on a stand-in base that carries vLLM's CPU build (images/standins/). Two things cannot be as on a B70
host: the weights (tiny generated models stand in) and the options the CPU build refuses. Both are listed in one
file, and `apply_overlay` is the only change a rehearsal makes to a render: it removes or resets the listed options
of the server's arguments and leaves the unit, its docker options, environment, entrypoint and image as they are.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError

from b70ctl.documents import Pinned
from b70ctl.errors import BadInput, first_problem
from b70ctl.files import read_yaml_mapping
from b70ctl.serve.render import ServeCommand

OVERLAY_PATH = Path(__file__).with_name("rehearsal.yaml")
MAX_OVERLAY_BYTES = 64 * 1024


class DroppedOption(Pinned):
    option: str = Field(pattern=r"^--[a-z0-9][a-z0-9-]*$", description="A vLLM server option, removed with its value")
    why: str = Field(min_length=1, description="Why the CPU build cannot run it, with its own words")
    refusal: str = Field(min_length=1, description="The refusal the CPU build prints when it is given the option")


class ReplacedOption(Pinned):
    option: str = Field(pattern=r"^--[a-z0-9][a-z0-9-]*$", description="A vLLM server option the render holds")
    value: str = Field(min_length=1, description="The value the CPU build can run it with")
    why: str = Field(min_length=1, description="Why the CPU build cannot run the recipe's value, with its own words")


class RecipeOverlay(Pinned):
    models: str = Field(min_length=1, description="What stands in for the recipe's weights")
    drop: list[DroppedOption] = Field(default_factory=list)
    replace: list[ReplacedOption] = Field(default_factory=list)


class RehearsalOverlay(Pinned):
    schema_version: Literal[1]
    recipes: dict[str, RecipeOverlay]


@cache
def load_overlay(path: Path = OVERLAY_PATH) -> RehearsalOverlay:
    data = read_yaml_mapping(path, f"rehearsal overlay {path}", "restore it from the repository", MAX_OVERLAY_BYTES)
    try:
        return RehearsalOverlay.model_validate(data)
    except ValidationError as error:
        raise BadInput(f"rehearsal overlay {path}: {first_problem(error)}") from error


def recipe_overlay(recipe: str) -> RecipeOverlay:
    overlay = load_overlay().recipes.get(recipe)
    if overlay is None:
        raise BadInput(f"--rehearsal: recipe {recipe} has no rehearsal overlay: rehearse one of "
                       f"{', '.join(sorted(load_overlay().recipes))}")
    return overlay


def _find(argv: list[str], option: str) -> tuple[int, int] | None:
    """Where OPTION is in argv and how many words it takes (`--option VALUE`, `--option=VALUE` or a bare flag)."""
    for at, word in enumerate(argv):
        if word.startswith(option + "="):
            return at, 1
        if word == option:
            return at, 2 if at + 1 < len(argv) and not argv[at + 1].startswith("--") else 1
    return None


def apply_overlay(command: ServeCommand, overlay: RecipeOverlay, speculative: bool = True) -> ServeCommand:
    """The render without the overlay's dropped options and with its replaced values; nothing else changes. The
    speculative server must hold every option the overlay names (else the overlay is out of date with its recipe,
    refused); the baseline holds only some (it has no speculative config)."""
    argv = list(command.argv)
    changes: list[DroppedOption | ReplacedOption] = [*overlay.drop, *overlay.replace]
    for change in changes:
        found = _find(argv, change.option)
        if found is None:
            if speculative:
                raise BadInput(f"rehearsal overlay changes {change.option}, which the render does not hold: update "
                               f"{OVERLAY_PATH.name} to the recipe")
            continue
        at, words = found
        argv[at:at + words] = [change.option, change.value] if isinstance(change, ReplacedOption) else []
    return command.model_copy(update={"argv": argv})


def replacements_only(overlay: RecipeOverlay) -> RecipeOverlay:
    """The overlay without its drops: the rehearsal's first start, which keeps each option the overlay drops so the
    CPU build's refusal of it can be read, with the values it replaces (e.g. a tensor-parallel size the CPU build
    cannot bind) already set, so that no other refusal comes first."""
    return overlay.model_copy(update={"drop": []})
