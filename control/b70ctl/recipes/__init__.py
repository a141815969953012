"""Recipes shipped with b70ctl (recipes/data/*.yaml), loaded and validated into `Recipe` models."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from b70ctl.errors import BadInput, first_problem
from b70ctl.files import read_yaml_mapping
from b70ctl.recipes.model import Claim, Recipe, Workload

__all__ = ["Claim", "Recipe", "Workload", "load_recipe", "load_recipe_file", "recipe_names", "recipe_path"]


def _data_dir() -> Path:
    return Path(str(resources.files("b70ctl.recipes") / "data"))


def recipe_names() -> list[str]:
    return sorted(path.stem for path in _data_dir().glob("*.yaml"))


def recipe_path(name: str) -> Path:
    path = _data_dir() / f"{name}.yaml"
    if not path.is_file():
        raise BadInput(f"unknown recipe {name!r}: choose one of {', '.join(recipe_names())} (b70ctl recipes list)")
    return path


# A recipe is a page of YAML; anything much larger is not one (and /dev/zero would never end).
MAX_RECIPE_BYTES = 1 * 2**20
# What an inventory's b70_recipe may hold (a shipped name or a recipe file's path): every stage passes it on
# command lines and keys the play's documents by it.
RECIPE_REFERENCE = r"[A-Za-z0-9_./+-]+"


def load_recipe_file(path: Path) -> Recipe:
    data = read_yaml_mapping(path, f"recipe file {path}", "give the path of a recipe YAML file", MAX_RECIPE_BYTES)
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        raise BadInput(f"recipe file {path}: {first_problem(error)}") from error


def load_recipe(name_or_path: str) -> Recipe:
    """A shipped recipe by name, or a recipe file by path (anything with a slash or a .yaml suffix)."""
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        return load_recipe_file(Path(name_or_path))
    return load_recipe_file(recipe_path(name_or_path))
