"""Who serves the candidates: a small interface, so the tune does not care whether a server is a local process
(the embedded default, here) or the appliance's systemd unit on a B70 host.

`baseline()` serves the recipe's target-only baseline, `candidate(c)` the recipe with c's overrides; each yields
the endpoint once healthy and stops the server when the block ends. A candidate that does not become healthy
raises CandidateFailed: the tune disqualifies it and goes on. A baseline that does not start is the host's
problem (BadInput, exit 2).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol

from b70ctl.checks.client import Endpoint
from b70ctl.errors import B70Error
from b70ctl.host_documents import TopologyDocument
from b70ctl.recipes.model import Recipe
from b70ctl.report.model import RooflineInputs
from b70ctl.serve.render import ServeCommand, ServeContext, render_container
from b70ctl.tune.model import Candidate


class CandidateFailed(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class CandidateServers(Protocol):
    def baseline(self) -> AbstractContextManager[Endpoint]: ...

    def candidate(self, candidate: Candidate) -> AbstractContextManager[Endpoint]: ...


def server_name(candidate: Candidate) -> str:
    """A file-name-safe name of the candidate's server (its log file is named after it)."""
    return "candidate-" + (re.sub(r"[^A-Za-z0-9.=]+", "-", candidate.label).strip("-") or "default")


def candidate_command(recipe: Recipe, candidate: Candidate, context: ServeContext,
                      topology: TopologyDocument | None) -> ServeCommand:
    """The candidate's serve command on an appliance host: the recipe with its overrides through render_container,
    its oneCCL thresholds on top of the host's profile (the serve context's env wins over the profile's). What a
    unit-owning implementation of CandidateServers starts."""
    context = context.model_copy(update={
        "extra_env": {**context.extra_env, **candidate.host_env},
        "prefix_cache_probe_passed": context.prefix_cache_probe_passed or candidate.probes_prefix_cache})
    return render_container(recipe.with_overrides(candidate.overrides), context, topology)


class LocalServing:
    """vLLM as local processes (LocalServer), rendered by render_serve like the appliance's unit: one at a time,
    so a candidate's measurement shares the machine with nothing the tune started."""

    def __init__(self, recipe: Recipe, models_dir: Path, log_dir: Path, python: str | None = None,
                 timeout_s: float = 900.0, request_timeout_s: float = 120.0,
                 progress: Callable[[str], None] | None = None):
        self.recipe = recipe
        self.models_dir = Path(models_dir)
        self.log_dir = Path(log_dir)
        self.python = python or sys.executable
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s
        self.progress = progress or (lambda _message: None)
        self.started = 0

    def _serve(self, name: str, recipe: Recipe, speculative: bool, extra_env: dict[str, str],
               probes_prefix_cache: bool = False) -> Generator[Endpoint, None, None]:
        from b70ctl.serve.local import LocalServer, free_port
        from b70ctl.serve.render import model_paths, render_serve

        target, drafter = model_paths(self.models_dir, recipe)
        context = ServeContext(model_dir=target, drafter_dir=drafter, port=free_port(), speculative=speculative,
                               python=self.python, extra_env=extra_env,
                               prefix_cache_probe_passed=probes_prefix_cache)
        server = LocalServer(name, render_serve(recipe, context), self.python, context.port,
                             self.log_dir / f"{name}.log")
        self.started += 1
        self.progress(f"starting vLLM ({name}) on {server.url}")
        server.start()
        try:
            server.wait_healthy(self.timeout_s)
            self.progress(f"vLLM ({name}) healthy")
            yield Endpoint(server.url, model=recipe.serve.served_model_name, timeout_s=self.request_timeout_s)
        finally:
            server.stop()

    def roofline_inputs(self) -> RooflineInputs:
        """The roofline's inputs where these servers run: the target's files and this machine's copy bandwidth."""
        from b70ctl.serve.render import model_paths
        from b70host.roofline_inputs import collect

        return RooflineInputs.model_validate(collect(model_paths(self.models_dir, self.recipe)[0],
                                                     copy_benchmark=True))

    @contextmanager
    def baseline(self) -> Iterator[Endpoint]:
        yield from self._serve("baseline", self.recipe, False, {})

    @contextmanager
    def candidate(self, candidate: Candidate) -> Iterator[Endpoint]:
        recipe = self.recipe.with_overrides(candidate.overrides)
        serving = self._serve(server_name(candidate), recipe, True, candidate.host_env,
                              candidate.probes_prefix_cache)
        try:
            endpoint = next(serving)
        except B70Error as error:
            raise CandidateFailed(str(error)) from error
        try:
            yield endpoint
        finally:
            serving.close()
