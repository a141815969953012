"""The embedded default: real vLLM on the CPU serving the generated tiny Qwen3, for machines without a B70.

Used by `b70ctl demo` and by the real-vLLM tests. Servers are rendered by the same `render_serve` as the
appliance's systemd unit; only the process runs locally instead of in the CPU image.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from b70ctl.recipes import Recipe, load_recipe
from b70ctl.recipes.model import SpeculativeSettings
from b70ctl.serve.local import LocalServer, free_port
from b70ctl.serve.render import ServeContext, render_serve

RECIPE = "cpu-tiny"

# The variants the tests (and the benchmark) serve: drafter directory role, or a speculative override.
VARIANTS: dict[str, dict[str, object]] = {
    "baseline": {"speculative": False},
    "draft-perturbed": {"drafter": "draft-perturbed"},
    "draft-exact": {"drafter": "draft-exact"},
    "ngram": {"method": SpeculativeSettings(method="ngram", num_speculative_tokens=4,
                                            prompt_lookup_min=2, prompt_lookup_max=4)},
}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "b70ctl"


def ensure_models(recipe: Recipe, models_dir: Path) -> dict[str, object]:
    """Generate the recipe's tiny models once; a re-run with the same spec is a no-op."""
    from b70ctl.models import tiny

    assert recipe.tiny is not None, "only generated recipes have tiny models"
    return tiny.generate(models_dir, recipe.tiny)


def variant_recipe(recipe: Recipe, variant: str) -> Recipe:
    method = VARIANTS[variant].get("method")
    if method is None:
        return recipe
    return recipe.model_copy(update={"serve": recipe.serve.model_copy(update={"speculative": method})})


def make_server(variant: str, models_dir: Path, log_dir: Path, recipe: Recipe | None = None,
                python: str | None = None, port: int | None = None) -> LocalServer:
    recipe = recipe or load_recipe(RECIPE)
    options = VARIANTS[variant]
    drafter_role = str(options.get("drafter") or (recipe.drafter.generated if recipe.drafter else ""))
    context = ServeContext(
        model_dir=str(models_dir / "target"),
        drafter_dir=str(models_dir / drafter_role) if drafter_role else None,
        port=port or free_port(),
        speculative=bool(options.get("speculative", True)),
    )
    command = render_serve(variant_recipe(recipe, variant), context)
    return LocalServer(variant, command, python or sys.executable, context.port, log_dir / f"{variant}.log")


def start_servers(variants: list[str], models_dir: Path, log_dir: Path,
                  progress: Callable[[str], None] | None = None, timeout_s: float = 600.0,
                  at_once: int = 2) -> dict[str, LocalServer]:
    """Start the variants, `at_once` at a time (each start is CPU-bound: importing vLLM and warming up), and
    wait until all are healthy; on any failure, stop them all."""
    servers = {name: make_server(name, models_dir, log_dir) for name in variants}
    pending = list(servers.values())
    try:
        while pending:
            batch, pending = pending[:at_once], pending[at_once:]
            for server in batch:
                server.start()
                if progress:
                    progress(f"starting vLLM ({server.name}) on {server.url}")
            for server in batch:
                server.wait_healthy(timeout_s)
                if progress:
                    progress(f"vLLM ({server.name}) healthy")
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


def serve_forever(variants: list[str]) -> None:
    """`python -m b70ctl.verify.embedded serve [VARIANT ...]`: start servers for iterating on the real-vLLM tests and
    print the B70CTL_TEST_SERVERS value that points the tests at them; Ctrl-C stops them."""
    recipe = load_recipe(RECIPE)
    models_dir = default_cache_dir() / "tiny-models"
    ensure_models(recipe, models_dir)
    servers = start_servers(variants or list(VARIANTS), models_dir, models_dir.parent / "server-logs",
                            progress=lambda message: print(message, flush=True))
    print("B70CTL_TEST_SERVERS=" + ",".join(f"{name}={server.url}" for name, server in servers.items()),
          flush=True)
    # SIGTERM (kill, or a background job whose SIGINT the shell ignores) stops the servers like Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        raise SystemExit("usage: python -m b70ctl.verify.embedded serve "
                         "[baseline|draft-exact|draft-perturbed|ngram ...]")
    serve_forever(sys.argv[2:])
