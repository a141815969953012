"""The report names the compute runtime (UMD) the serving image bundles, as the recipe's bill of materials states
it: the host's installed one is not what vLLM runs inside the container."""

from __future__ import annotations

from b70ctl.report.markdown import render_markdown
from fleet_factory import make_report, shipped_recipe


def test_the_report_names_the_images_umd():
    # intel/llm-scaler #618 (https://github.com/intel/llm-scaler/issues/618): "intel/llm-scaler-vllm:0.21.0-b3.1
    # bundles compute-runtime 26.14.37833.4" (route a's base image).
    recipe = shipped_recipe("pr620-fp8-tp2")
    lines = render_markdown(make_report("pr620-fp8-tp2", "b70-a"), recipe).splitlines()
    assert ("- Image compute runtime: 26.14.37833.4 (intel/llm-scaler #618: llm-scaler-vllm 0.21.0-b3.1 bundles "
            "26.14.37833.4)") in lines


def test_no_line_when_the_recipe_does_not_say():
    recipe = shipped_recipe("dspark-int4-tp1")
    assert recipe.image.compute_runtime is None
    markdown = render_markdown(make_report("dspark-int4-tp1", "b70-a"), recipe)
    assert "Image compute runtime" not in markdown
