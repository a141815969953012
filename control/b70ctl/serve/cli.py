"""b70ctl serve: the serve command of a recipe on a host, as the vllm_serve role will run it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from b70ctl.host.model import load_topology
from b70ctl.recipes import load_recipe
from b70ctl.serve.render import ServeContext, render_serve, render_xpu_container

app = typer.Typer(no_args_is_help=True, help="The vLLM serve command, rendered from recipe and host facts.")


@app.command("render")
def render(
    recipe: Annotated[str, typer.Option(help="Recipe name or recipe file")],
    model_dir: Annotated[str, typer.Option(help="Target model directory as the server sees it")] = "/models/target",
    drafter_dir: Annotated[str, typer.Option(help="Drafter directory as the server sees it")] = "/models/drafter",
    port: Annotated[int, typer.Option(help="Port the server listens on")] = 8000,
    topology: Annotated[Path | None, typer.Option(
        help="The host's topology.json (b70ctl host topology --write); required for XPU recipes")] = None,
    baseline: Annotated[bool, typer.Option(help="Render the target-only baseline (no speculation)")] = False,
) -> None:
    """Print {"argv", "env", "docker_args"} as JSON: the one rendering every consumer uses."""
    loaded = load_recipe(recipe)
    context = ServeContext(model_dir=model_dir, drafter_dir=drafter_dir, host="0.0.0.0", port=port,
                           speculative=not baseline)
    if loaded.host.accelerator == "xpu":
        if topology is None:
            from b70ctl.errors import BadInput

            raise BadInput(f"recipe {loaded.name} runs on XPU: pass --topology /etc/b70/topology.json (written by "
                           "`b70ctl host topology --write` or the gpu_topology role)")
        try:
            command = render_xpu_container(loaded, context, load_topology(topology))
        except ValueError as error:
            from b70ctl.errors import BadInput

            raise BadInput(f"{error}: use a host with more GPUs or a recipe with a smaller TP") from error
    else:
        command = render_serve(loaded, context)
    sys.stdout.write(json.dumps(command.model_dump(), indent=2) + "\n")
