"""`b70ctl recipes`: the recipes b70ctl ships, each validated, and preflight's check of a play's recipes and locks."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from b70ctl.options import json_option, print_json, shown
from b70ctl.recipes import load_recipe, recipe_names

app = typer.Typer(no_args_is_help=True, help="The recipes b70ctl ships.")


@app.command("list")
def recipes_list(as_json: Annotated[bool, json_option()] = False) -> None:
    """List the shipped recipes."""
    recipes = [load_recipe(name) for name in recipe_names()]
    if as_json:
        print_json([{"name": r.name, "route": r.route, "vllm_version": r.vllm_version,
                     "description": r.description} for r in recipes])
        return
    table = Table("name", "route", "vLLM", "TP", "speculation", "description")
    for recipe in recipes:
        spec = recipe.serve.speculative
        table.add_row(shown(recipe.name), shown(recipe.route), shown(recipe.vllm_version),
                      str(recipe.serve.tensor_parallel_size),
                      shown(f"{spec.method} k={spec.num_speculative_tokens}") if spec else "-",
                      shown(recipe.description))
    Console().print(table)


@app.command("show")
def recipes_show(name: Annotated[str, typer.Argument(help="Recipe name or path to a recipe file")],
                 as_json: Annotated[bool, json_option()] = False) -> None:
    """Show one recipe, validated, with its claims."""
    recipe = load_recipe(name)
    if as_json:
        print_json(recipe.model_dump(mode="json"))
        return
    out = Console()
    out.print(f"[bold]{shown(recipe.name)}[/] — {shown(recipe.description)}")
    out.print(shown(f"route {recipe.route}, vLLM {recipe.vllm_version}, image {recipe.image.reference}"
                    f"{':' + recipe.image.tag if recipe.image.tag else ''} ({recipe.image.source})"))
    table = Table("claim", "metric", "bound", "source", title="claims")
    for claim in recipe.claims:
        table.add_row(shown(claim.id), shown(claim.metric), shown(claim.describe_bound()), shown(claim.source))
    out.print(table)


@app.command("check")
def recipes_check(
    recipes: Annotated[list[str], typer.Argument(help="The recipes (name or file) a play's hosts serve, as their "
                                                      "inventory names them; repeats are checked once")],
    as_json: Annotated[bool, json_option("Print each recipe's spec, lock status or error as JSON, keyed by RECIPE "
                                         "as given (what preflight reads)")] = False,
) -> None:
    """Preflight's question for every recipe of a play, before anything changes: is the recipe valid, and is its
    lock resolved (if not, the command that resolves it and the network that needs). Exit 1 when one is not; with
    --json the exit is 0 and each recipe's entry says it, so that a play fails only the hosts that name that
    recipe."""
    from b70ctl.lock.status import check_recipes

    checked = check_recipes(recipes)
    if as_json:
        sys.stdout.write(checked.model_dump_json(indent=2) + "\n")
        return
    out = Console(highlight=False, markup=False, soft_wrap=True)
    for key, entry in checked.recipes.items():
        out.print(f"{key}: " + (f"cannot be used: {entry.error}" if entry.error else entry.lock.message
                                if entry.lock else "ok"))
    if any(entry.error or (entry.lock and not entry.lock.resolved) for entry in checked.recipes.values()):
        raise typer.Exit(1)
