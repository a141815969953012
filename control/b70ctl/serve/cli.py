"""b70ctl serve: the serve command of a recipe on a host, as the vllm_serve role will run it."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from b70ctl.errors import BadInput, first_problem
from b70ctl.files import parse_json
from b70ctl.host_documents import TopologyDocument, load_topology
from b70ctl.models.record import ModelsRecord, parse_models_record
from b70ctl.options import json_option
from b70ctl.recipes import load_recipe
from b70ctl.recipes.model import Recipe, env_problem, site_env_problem
from b70ctl.serve.rehearsal import RecipeOverlay, apply_overlay, recipe_overlay, replacements_only
from b70ctl.serve.render import (
    DEFAULT_COMPILE_CACHE_DIR,
    DEFAULT_NEO_CACHE_MAX_BYTES,
    ServeCommand,
    ServeContext,
    render_container,
)
from b70ctl.serve.unit import (
    CONTAINER_MODELS_DIR,
    SERVICE_USER,
    SYSTEMD_DIR,
    HostServer,
    HostUnits,
    ServingContainer,
    serve_unit,
    unit_file_text,
)

app = typer.Typer(no_args_is_help=True, help="The vLLM serve command, rendered from recipe and host facts.")


def _topology(path: Path) -> TopologyDocument:
    """A topology file, or '-' for the document on stdin (the vllm_serve role pipes the host's copy in)."""
    if str(path) != "-":
        return load_topology(path)
    try:
        return TopologyDocument.model_validate_json(sys.stdin.read())
    except ValidationError as error:
        raise BadInput(f"topology on stdin is not a topology document ({error.error_count()} errors, first: "
                       f"{error.errors()[0]['msg']}): pipe in /etc/b70/topology.json") from error


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise BadInput(f"--env {pair!r} is not NAME=VALUE: write it as --env NAME=VALUE")
        problem = env_problem(name, value)
        if problem is not None:
            raise BadInput(f"--env {problem}")
        env[name] = value
    return env


def _json_env(text: str | None) -> dict[str, str]:
    """--env-json as NAME: VALUE, each entry checked as --env's are. A value is a string or a number (a YAML dict's
    8 or 0.9 is meant as text), never an object, a list or null. Names are checked as given, never joined into
    NAME=VALUE text first: a name holding '=' would read back as another name."""
    if text is None:
        return {}
    fix = 'give one JSON object of NAME: value, e.g. {"VLLM_LOGGING_LEVEL": "DEBUG"}'
    try:
        data = parse_json(text, "--env-json", fix)
    except json.JSONDecodeError as error:
        raise BadInput(f"--env-json is not JSON ({error.msg}): {fix}") from None
    if not isinstance(data, dict):
        raise BadInput(f"--env-json: expected a JSON object of NAME: value, found {type(data).__name__}")
    env: dict[str, str] = {}
    for name, value in data.items():
        problem = site_env_problem(name, value)
        if problem is not None:
            raise BadInput(f"--env-json {problem}")
        env[name] = str(value)
    return env


def _with_site_env(recipe: Recipe, env: dict[str, str]) -> Recipe:
    """The recipe as it will run with a site's extra env: validated again by the recipe model, so its known-bad
    rules (dspark without Model Runner V2, ...) refuse a site setting the same way they refuse a recipe file."""
    if not env:
        return recipe
    serve = recipe.serve.model_dump() | {"env": {**recipe.serve.env, **env}}
    try:
        return Recipe.model_validate(recipe.model_dump() | {"serve": serve})
    except ValidationError as error:
        reason = error.errors()[0]["msg"].removeprefix("Value error, ")
        names = ", ".join(f"--env {name}={value}" for name, value in env.items())
        raise BadInput(f"recipe {recipe.name} with {names}: {reason} (drop it from vllm_serve_extra_env)") from error


def _container(unit: str, image: str | None, env_file: str | None, api_key_env_file: str | None,
               record: ModelsRecord | None, context: ServeContext, site_env: dict[str, str]) -> ServingContainer:
    """The unit's container (record: --models-record, parsed); extra_env is the site's alone: a tune renders each
    candidate from the recipe again, so the served configuration's tuned settings must not carry into it."""
    missing = [flag for flag, value in (("--image", image), ("--env-file", env_file),
                                        ("--models-record", record)) if not value]
    if missing:
        raise BadInput(f"--unit {unit} needs {', '.join(missing)}: the unit's ExecStart runs that image with that "
                       "environment file and mounts that model store")
    assert image is not None and env_file is not None and record is not None
    try:
        return ServingContainer(unit=unit, image=image, env_file=env_file, api_key_env_file=api_key_env_file,
                                models_dir=record.store_dir(), models_label=record.label(), model_dir=context.model_dir,
                                drafter_dir=context.drafter_dir, port=context.port, extra_env=site_env,
                                compile_cache_dir=context.compile_cache_dir,
                                neo_cache_max_bytes=context.neo_cache_max_bytes,
                                prefix_cache_probe_passed=context.prefix_cache_probe_passed)
    except ValidationError as error:
        raise BadInput(f"--unit {unit}: {first_problem(error)}") from error


def _render_server(recipe: Recipe, document: TopologyDocument | None, tuned: str | None, site_env: dict[str, str],
                   model_dir: str, drafter_dir: str | None, port: int, baseline: bool, compile_cache_dir: str,
                   neo_cache_max_bytes: int, rehearsal: RecipeOverlay | None = None,
                   prefix_cache_probe_passed: bool = False) -> tuple[ServeCommand, ServeContext]:
    """One server's render: the speculative server with the host's tuned overrides, or the target-only baseline
    as the recipe says (it is the tune's reference); in a rehearsal, without the options its overlay removes."""
    from b70ctl.serve.tuned import apply_tuned, parse_tuned, probe_passed

    tuned_env: dict[str, str] = {}
    if tuned is not None and not baseline:
        settings = parse_tuned(tuned)
        recipe, tuned_env = apply_tuned(recipe, settings, document.profile if document else None)
        prefix_cache_probe_passed = prefix_cache_probe_passed or probe_passed(settings)
    try:
        context = ServeContext(model_dir=model_dir, drafter_dir=drafter_dir, host="0.0.0.0", port=port,
                               speculative=not baseline, extra_env={**site_env, **tuned_env},
                               compile_cache_dir=compile_cache_dir, neo_cache_max_bytes=neo_cache_max_bytes,
                               prefix_cache_probe_passed=prefix_cache_probe_passed)
    except ValidationError as error:
        field = str(error.errors()[0]["loc"][0])
        if field in ("compile_cache_dir", "neo_cache_max_bytes"):
            raise BadInput(f"--{field.replace('_', '-')}: {first_problem(error)}: give an absolute directory without "
                           "':' (or '') and a byte count >= 0") from error
        raise BadInput(f"--port {port}: {first_problem(error)}: give a TCP port from 1 to 65535") from error
    try:
        command = render_container(recipe, context, document)
    except ValueError as error:
        raise BadInput(f"{error}: pass --topology /etc/b70/topology.json of a host with enough GPUs, or choose a "
                       "recipe that fits") from error
    if rehearsal is not None:
        command = apply_overlay(command, rehearsal, speculative=not baseline)
    return command, context


@app.command("render")
def render(
    recipe: Annotated[str, typer.Option(help="Recipe name or recipe file")],
    model_dir: Annotated[str, typer.Option(help="Target model directory as the server sees it")] = "/models/target",
    drafter_dir: Annotated[str, typer.Option(help="Drafter directory as the server sees it")] = "/models/drafter",
    port: Annotated[int, typer.Option(help="Port the server listens on")] = 8000,
    topology: Annotated[Path | None, typer.Option(
        help="The host's topology.json (b70ctl host topology --write), or - for stdin; required for XPU recipes")
    ] = None,
    baseline: Annotated[bool, typer.Option(help="Render the target-only baseline (no speculation)")] = False,
    env: Annotated[list[str] | None, typer.Option(
        help="Extra NAME=VALUE for the server's environment (a site's own setting; repeatable)")] = None,
    env_json: Annotated[str | None, typer.Option(
        help="Extra environment as one JSON object of NAME: value (how a role passes vllm_serve_extra_env); "
             "taken after --env")] = None,
    tuned: Annotated[str | None, typer.Option(
        help="The host's vllm_serve_tuned (host_vars/<host>/b70_tuned.yml) as JSON: its overrides are applied to "
             "the speculative server ({} or absent: the recipe as it is)")] = None,
    as_json: Annotated[bool, json_option('Print {"argv", "env", "docker_args", "prefix_caching"} as JSON')] = False,
    compile_cache_dir: Annotated[str, typer.Option(
        help="XPU: host directory of the compile caches the container mounts ('' for none)")
    ] = DEFAULT_COMPILE_CACHE_DIR,
    neo_cache_max_bytes: Annotated[int, typer.Option(help="XPU: NEO_CACHE_MAX_SIZE of the kernel cache, bytes")
                                   ] = DEFAULT_NEO_CACHE_MAX_BYTES,
    unit: Annotated[str | None, typer.Option(
        help="Also give the systemd unit's whole ExecStart and its container record (with --json: exec_start, "
             "exec_start_line, container); needs --image, --env-file and --models-record")] = None,
    image: Annotated[str | None, typer.Option(help="--unit: the image id the unit serves")] = None,
    env_file: Annotated[str | None, typer.Option(help="--unit: the unit's environment file on the host")] = None,
    api_key_env_file: Annotated[str | None, typer.Option(
        help="--unit: the host file holding VLLM_API_KEY (when the server has a key)")] = None,
    models_record: Annotated[str | None, typer.Option(
        help="--unit: the host's /etc/b70/models.json as JSON (its target's directory is mounted at /models)")
    ] = None,
    prefix_cache_probe_passed: Annotated[bool, typer.Option(
        "--prefix-cache-probe-passed", help="The gate's prefix-cache probe passed on this host with prefix caching "
                                            "on: a speculating hybrid target on vLLM >= 0.28.1 may keep it (without: "
                                            "--no-enable-prefix-caching)")] = False,
) -> None:
    """The server's command line, environment and docker options: the one rendering every consumer uses."""
    site_env = _env_pairs(env or []) | _json_env(env_json)
    loaded = _with_site_env(load_recipe(recipe), site_env)
    document = _topology(topology) if topology is not None else None
    command, context = _render_server(loaded, document, tuned, site_env, model_dir, drafter_dir, port, baseline,
                                      compile_cache_dir, neo_cache_max_bytes,
                                      prefix_cache_probe_passed=prefix_cache_probe_passed)
    if unit is not None:
        record = parse_models_record(models_record, "--models-record") if models_record else None
        served = serve_unit(command, _container(unit, image, env_file, api_key_env_file, record, context, site_env))
        if as_json:
            sys.stdout.write(served.model_dump_json(indent=2) + "\n")
        else:
            sys.stdout.write(f"ExecStart={served.exec_start_line}\n")
        return
    if any(value is not None for value in (image, env_file, api_key_env_file, models_record)):
        raise BadInput("--image, --env-file, --api-key-env-file and --models-record describe a unit: give --unit NAME")
    if as_json:
        sys.stdout.write(json.dumps(command.model_dump(), indent=2) + "\n")
        return
    # Shell-quoted, so each part can be pasted: what the unit's env file, ExecStart and docker run hold.
    lines = ["environment:", *(f"  {name}={shlex.quote(value)}" for name, value in sorted(command.env.items())),
             "server arguments:", f"  {shlex.join(command.argv)}"]
    if command.docker_args:
        lines += ["docker run options:", f"  {shlex.join(command.docker_args)}"]
    sys.stdout.write("\n".join(lines) + "\n")


# A unit's name is also its container's: docker's rule for container names (moby daemon/names/names.go,
# RestrictedNamePattern `^[a-zA-Z0-9][a-zA-Z0-9_.-]+$`: two characters at least), which systemd's for unit names
# admits, within its 255 characters with the ".service" suffix (systemd.unit(5)).
UNIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{1,246}")


@app.command("units")
def units(
    recipe: Annotated[str, typer.Option(help="Recipe name or recipe file")],
    image: Annotated[str, typer.Option(help="The image id the units serve")],
    models_record: Annotated[str, typer.Option(
        help="The host's /etc/b70/models.json as JSON (its target's directory is mounted at /models)")],
    config_dir: Annotated[str, typer.Option(
        help="The host's serving configuration directory: each unit's environment file and the container record")],
    user: Annotated[str, typer.Option(help="The service user the units run as (User=)")],
    model_dir: Annotated[str | None, typer.Option(
        help="Target model directory as the server sees it (default: the models record's, below /models)")] = None,
    drafter_dir: Annotated[str | None, typer.Option(
        help="Drafter directory as the server sees it (default: the models record's, below /models)")] = None,
    unit: Annotated[str, typer.Option(help="The speculative server's unit (and container) name")] = "b70-vllm",
    port: Annotated[int, typer.Option(help="The speculative server's port")] = 8000,
    baseline_unit: Annotated[str | None, typer.Option(
        help="Also serve the recipe's target alone (the greedy-correctness baseline) as this unit")] = None,
    baseline_port: Annotated[int, typer.Option(help="The baseline's port")] = 8001,
    topology: Annotated[Path | None, typer.Option(
        help="The host's topology.json, or - for stdin; required for XPU recipes")] = None,
    tuned: Annotated[str | None, typer.Option(
        help="The host's vllm_serve_tuned as JSON, applied to the speculative server")] = None,
    env: Annotated[list[str] | None, typer.Option(help="Extra NAME=VALUE for the servers' environment (repeatable)")
                   ] = None,
    env_json: Annotated[str | None, typer.Option(
        help="Extra environment as one JSON object of NAME: value (vllm_serve_extra_env); taken after --env")] = None,
    api_key_env_file: Annotated[str | None, typer.Option(
        help="The host file holding VLLM_API_KEY (when the servers have a key)")] = None,
    compile_cache_dir: Annotated[str, typer.Option(
        help="XPU: host directory of the compile caches the containers mount ('' for none)")
    ] = DEFAULT_COMPILE_CACHE_DIR,
    neo_cache_max_bytes: Annotated[int, typer.Option(help="XPU: NEO_CACHE_MAX_SIZE of the kernel cache, bytes")
                                   ] = DEFAULT_NEO_CACHE_MAX_BYTES,
    systemd_dir: Annotated[str, typer.Option(help="Where the unit files go")] = SYSTEMD_DIR,
    rehearsal: Annotated[bool, typer.Option(
        "--rehearsal", help="Render for a rehearsal (make rehearse): drop or reset the options the recipe's overlay "
                            "in serve/rehearsal.yaml lists, which vLLM's CPU build cannot run; serve.json records it")
    ] = False,
    rehearsal_keep_dropped: Annotated[bool, typer.Option(
        "--rehearsal-keep-dropped", help="With --rehearsal: set only the values the overlay replaces and keep the "
                                         "options it drops, to read the CPU build's refusal of each (the "
                                         "rehearsal's first start)")] = False,
    prefix_cache_probe_passed: Annotated[bool, typer.Option(
        "--prefix-cache-probe-passed", help="The gate's prefix-cache probe passed on this host with prefix caching "
                                            "on: a speculating hybrid target on vLLM >= 0.28.1 may keep it (without: "
                                            "--no-enable-prefix-caching)")] = False,
    as_json: Annotated[bool, json_option("Print every unit's files as JSON (what the vllm_serve role writes)")
                       ] = False,
) -> None:
    """Every serving unit of a host, as the vllm_serve role installs them: the speculative server and, with
    --baseline-unit, its target-only baseline; for each the unit file (the whole ExecStart included) and the
    environment file with their paths, then serve.json, the container record a tune reads, and the files a
    rollback puts back."""
    names = [unit] + ([baseline_unit] if baseline_unit is not None else [])
    for flag, name in zip(("--unit", "--baseline-unit"), names):
        if not UNIT_NAME.fullmatch(name):
            raise BadInput(f"{flag} {name!r} is not a unit and container name: use 2 to 247 letters, digits and "
                           "_ . -, starting with a letter or digit")
    if baseline_unit is not None and (baseline_unit == unit or baseline_port == port):
        raise BadInput(f"--baseline-unit {baseline_unit} on port {baseline_port} collides with --unit {unit} on "
                       f"port {port}: give the baseline its own unit name and port")
    if not re.fullmatch(SERVICE_USER, user):
        raise BadInput(f"--user {user!r} is not a user name: lower-case letters, digits, _ and -, up to 32")
    site_env = _env_pairs(env or []) | _json_env(env_json)
    loaded = _with_site_env(load_recipe(recipe), site_env)
    document = _topology(topology) if topology is not None else None
    record = parse_models_record(models_record, "--models-record")
    if rehearsal_keep_dropped and not rehearsal:
        raise BadInput("--rehearsal-keep-dropped is a kind of --rehearsal: give both")
    overlay = recipe_overlay(loaded.name) if rehearsal else None
    if overlay is not None and rehearsal_keep_dropped:
        overlay = replacements_only(overlay)
    recorded_target, recorded_drafter = record.in_container(CONTAINER_MODELS_DIR)
    served_target, served_drafter = model_dir or recorded_target, drafter_dir or recorded_drafter
    if served_drafter is None and loaded.drafter is not None:
        raise BadInput(f"--models-record holds no drafter, and recipe {loaded.name} has one: install the recipe's "
                       "models first (playbooks/models.yml writes the record), or give --drafter-dir")
    servers: list[HostServer] = []
    measured = None  # the speculative server's render: what serve.json and a tune read
    for name, server_port, baseline in [(unit, port, False)] + (
            [(baseline_unit, baseline_port, True)] if baseline_unit is not None else []):
        command, context = _render_server(loaded, document, tuned, site_env, served_target, served_drafter,
                                          server_port, baseline, compile_cache_dir, neo_cache_max_bytes, overlay,
                                          prefix_cache_probe_passed)
        env_path = f"{config_dir}/{name}.env"
        served = serve_unit(command, _container(name, image, env_path, api_key_env_file, record, context, site_env),
                            rehearsal=overlay)
        servers.append(HostServer(
            unit=name, port=server_port, baseline=baseline, unit_path=f"{systemd_dir}/{name}.service",
            unit_file=unit_file_text(loaded.name, name, server_port, baseline, user, served.exec_start),
            env_file_path=env_path, env_file=served.files.env_file, exec_start_line=served.exec_start_line))
        if not baseline:
            measured = served
    assert measured is not None
    host_units = HostUnits(servers=servers, serve_json=measured.files.serve_json,
                           container_path=f"{config_dir}/{unit}.container.json",
                           container_json=measured.files.container_json,
                           config_files=[server.unit_path for server in servers]
                           + [server.env_file_path for server in servers])
    if as_json:
        sys.stdout.write(host_units.model_dump_json(indent=2) + "\n")
        return
    for server in host_units.servers:
        sys.stdout.write(f"{server.unit_path}:\n{server.unit_file}{server.env_file_path}:\n{server.env_file}\n")
