"""b70ctl: the appliance's command line. Each command parses its arguments, calls one function and renders the
result: rich for people, --json for machines. Exit codes: 0 ok, 1 a check failed, 2 bad input or unreachable."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from b70ctl.errors import BadInput
from b70ctl.recipes import load_recipe, recipe_names

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
recipes_app = typer.Typer(no_args_is_help=True, help="The recipes b70ctl ships.")
app.add_typer(recipes_app, name="recipes")
app.add_typer(__import__("b70ctl.lock.cli", fromlist=["app"]).app, name="lock")
app.add_typer(__import__("b70ctl.models.cli", fromlist=["app"]).app, name="model")
app.add_typer(__import__("b70ctl.host.cli", fromlist=["app"]).app, name="host")
app.add_typer(__import__("b70ctl.fleet.cli", fromlist=["app"]).app, name="fleet")
app.add_typer(__import__("b70ctl.image.cli", fromlist=["app"]).app, name="image")

console = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    """One line on stderr and the exit code; never a traceback for a user's mistake."""
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


@recipes_app.command("list")
def recipes_list(as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False) -> None:
    """List the shipped recipes."""
    recipes = [load_recipe(name) for name in recipe_names()]
    if as_json:
        print_json([{"name": r.name, "route": r.route, "vllm_version": r.vllm_version,
                     "description": r.description} for r in recipes])
        return
    table = Table("name", "route", "vLLM", "TP", "speculation", "description")
    for recipe in recipes:
        spec = recipe.serve.speculative
        table.add_row(recipe.name, recipe.route, recipe.vllm_version, str(recipe.serve.tensor_parallel_size),
                      f"{spec.method} k={spec.num_speculative_tokens}" if spec else "-", recipe.description)
    Console().print(table)


@recipes_app.command("show")
def recipes_show(name: Annotated[str, typer.Argument(help="Recipe name or path to a recipe file")],
                 as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False) -> None:
    """Show one recipe, validated, with its claims."""
    recipe = load_recipe(name)
    if as_json:
        print_json(recipe.model_dump(mode="json"))
        return
    out = Console()
    out.print(f"[bold]{recipe.name}[/] — {recipe.description}")
    out.print(f"route {recipe.route}, vLLM {recipe.vllm_version}, image {recipe.image.reference}"
              f"{':' + recipe.image.tag if recipe.image.tag else ''} ({recipe.image.source})")
    table = Table("claim", "metric", "bound", "source", title="claims")
    for claim in recipe.claims:
        if claim.op == "between":
            bound = f"{claim.low} .. {claim.high}"
        elif claim.op == "per_position":
            bound = " ".join(f"{v:.2f}" for v in claim.values or [])
        else:
            bound = f"{claim.op} {claim.value}"
        table.add_row(claim.id, claim.metric, bound, claim.source)
    out.print(table)


def main() -> None:
    try:
        app()
    except BadInput as error:
        console.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        sys.exit(error.exit_code)
