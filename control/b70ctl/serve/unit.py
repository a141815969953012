"""The serving units, written once: the unit file, its ExecStart (the `docker run` command systemd starts) and
their quoting.

`b70ctl serve units --json` gives the vllm_serve role every unit of a host (the speculative server and, where the
host has room, its target-only baseline) as files: each unit file and environment file with its path, serve.json,
the container record and the list of files a rollback puts back. The role copies them; it renders nothing.

`b70ctl serve render --unit NAME ... --json` gives one server: beside the render, the whole ExecStart
(`exec_start`, and `exec_start_line` as the unit file holds it), the container document
(<config_dir>/<unit>.container.json) and the text of each file written from the render (`files`). `b70ctl tune`
reads the container document back and serves each candidate through the same unit with a drop-in whose ExecStart
comes from the same ServingContainer.exec_start, with the candidate's render and environment file.

Quoting is systemd's (systemd.syntax(7), systemd.service(7) "Command lines"): each argument double-quoted, backslash
and double quote escaped, control characters as C escapes, % (specifiers) and $ (environment expansion) doubled, so
systemd reads back exactly the value and no value can end the line, open a quote or expand.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from b70ctl.documents import Document
from b70ctl.errors import BadInput
from b70ctl.serve.rehearsal import RecipeOverlay
from b70ctl.serve.render import DEFAULT_COMPILE_CACHE_DIR, DEFAULT_NEO_CACHE_MAX_BYTES, ServeCommand, ServeContext

DOCKER = "/usr/bin/docker"
SYSTEMD_DIR = "/etc/systemd/system"
# A login name as useradd(8) takes it (CAVEATS: [a-z_][a-z0-9_-]*[$]?, up to 32 characters; the trailing $ of
# machine accounts left out): nothing a unit's User= could read otherwise.
SERVICE_USER = r"^[a-z_][a-z0-9_-]{0,31}$"
# The host's model store, as the inventory may name it: an absolute path of plain components (none starting with
# '.', so no '..'), since it is the SRC of docker's --volume SRC:/models:ro, which moby splits on ':' (volume/mounts/
# linux_parser.go linuxSplitRawSpec: more than two ':' is an invalid spec), and is written into unit files.
MODEL_STORE_DIR = r"^(/[A-Za-z0-9_][A-Za-z0-9._+-]*)+$"
# Where the container sees the host's model store (read-only); the render's --model-dir/--drafter-dir are below it.
CONTAINER_MODELS_DIR = "/models"
# The label naming what models the container serves: a new models.json changes the ExecStart, so the unit restarts.
MODELS_LABEL = "org.b70.models"
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\", '"': '\\"', "%": "%%", "$": "$$"}


def systemd_exec_argument(value: object) -> str:
    """One command-line argument of ExecStart= (or ExecStop=), double-quoted and escaped."""
    out = []
    for character in str(value):
        if character in _ESCAPES:
            out.append(_ESCAPES[character])
        elif ord(character) < 32 or ord(character) == 127:
            out.append(f"\\x{ord(character):02x}")
        else:
            out.append(character)
    return '"' + "".join(out) + '"'


def systemd_text(value: object) -> str:
    """Free text in a setting's value or a comment (Description=): one line, specifiers taken literally."""
    text = " ".join(str(value).split())
    return "".join(character for character in text if ord(character) >= 32 and ord(character) != 127) \
        .replace("%", "%%")


def env_file_text(env: dict[str, str], header: str) -> str:
    """An EnvironmentFile= (systemd.exec(7)): a comment, then NAME=value lines sorted by name. A line break or control
    character in a name or value would end the assignment or be read otherwise: refused, in one line."""
    for name, value in env.items():
        if any(ord(character) < 32 or ord(character) == 127 for character in name + value):
            raise BadInput(f"environment {name}: the value holds a line break or control character")
    return f"# {systemd_text(header)}\n" + "".join(f"{name}={value}\n" for name, value in sorted(env.items()))


def exec_start_line(argv: list[str]) -> str:
    """ExecStart='s value: the arguments quoted, space-separated."""
    return " ".join(systemd_exec_argument(part) for part in argv)


class ServingContainer(Document):
    """<config_dir>/<unit>.container.json: how the unit runs its container, and the render's inputs, so that a
    tune's candidate runs in the unit's container with only the rendered parts (docker options, server arguments,
    environment) and the environment file replaced."""

    unit: str = Field(min_length=1, description="The unit, also the container's name")
    image: str = Field(min_length=1, description="The image id the unit serves")
    env_file: str = Field(description="The unit's environment file (the render's env)")
    api_key_env_file: str | None = Field(None, description="The file holding VLLM_API_KEY, when a key is set")
    models_dir: str = Field(description="The host's model store directory, mounted read-only at /models")
    models_label: str = Field(description=f"{MODELS_LABEL}: what the model store held when the unit was written")
    model_dir: str = Field(description="Target directory as the container sees it (--model-dir of the render)")
    drafter_dir: str | None = None
    port: int = Field(ge=1, le=65535)
    extra_env: dict[str, str] = Field(default_factory=dict, description="vllm_serve_extra_env")
    # The compile caches the role mounts (vllm_serve_compile_cache_*): a candidate reuses the unit's, so a tune's
    # restarts do not recompile what the served configuration already compiled.
    compile_cache_dir: str = DEFAULT_COMPILE_CACHE_DIR
    neo_cache_max_bytes: int = Field(DEFAULT_NEO_CACHE_MAX_BYTES, ge=0)
    prefix_cache_probe_passed: bool = Field(False, description="vllm_serve_prefix_cache_probe_passed: a tune's "
                                                               "candidates are rendered with the unit's")

    @field_validator("models_dir")
    @classmethod
    def _mountable(cls, value: str) -> str:
        if not re.fullmatch(MODEL_STORE_DIR, value):
            raise ValueError(f"{value!r} cannot be mounted as it is: an absolute path of letters, digits and . _ + - "
                             "(no spaces, quotes, ':' or ..)")
        return value

    def context(self, speculative: bool) -> ServeContext:
        """What the render is given for this container (the speculative server, or its target-only baseline)."""
        return ServeContext(model_dir=self.model_dir, drafter_dir=self.drafter_dir, host="0.0.0.0", port=self.port,
                            speculative=speculative, extra_env=self.extra_env,
                            compile_cache_dir=self.compile_cache_dir, neo_cache_max_bytes=self.neo_cache_max_bytes,
                            prefix_cache_probe_passed=self.prefix_cache_probe_passed)

    def exec_start(self, command: ServeCommand, env_file: str | None = None) -> list[str]:
        """The unit's command: docker run of the image with the render's options and arguments; a tune passes
        its candidate's own environment file."""
        return ([DOCKER, "run", "--rm", "--name", self.unit, "--env-file", env_file or self.env_file]
                + (["--env-file", self.api_key_env_file] if self.api_key_env_file else [])
                + ["--volume", f"{self.models_dir}:{CONTAINER_MODELS_DIR}:ro",
                   "--label", f"{MODELS_LABEL}={self.models_label}"]
                + command.docker_args + [self.image] + command.argv)


class ServedCommand(ServeCommand):
    """/etc/b70/serve.json: the measured server's render, the unit's whole ExecStart as the unit file holds it, and
    in a rehearsal the options its overlay removed (serve/rehearsal.yaml). The report shows all three."""

    exec_start_line: str | None = Field(None, description="The unit's ExecStart= value (systemd quoting)")
    rehearsal: RecipeOverlay | None = Field(None, description="A rehearsal's overlay: what stands in for the "
                                                              "weights, and the options it removed from the render")


class UnitFiles(Document):
    """What the vllm_serve role writes from one render, as the files hold it."""

    env_file: str = Field(description="<config_dir>/<unit>.env, the unit's EnvironmentFile=")
    serve_json: str = Field(description="/etc/b70/serve.json: the render (argv, env, docker_args) the report shows")
    container_json: str = Field(description="<config_dir>/<unit>.container.json, read back by b70ctl tune")


class ServeUnit(Document):
    """`b70ctl serve render --unit ... --json`: the render, the unit's whole ExecStart, the container record and the
    files the role writes."""

    argv: list[str]
    env: dict[str, str]
    docker_args: list[str]
    exec_start: list[str]
    exec_start_line: str
    container: ServingContainer
    files: UnitFiles


def serve_unit(command: ServeCommand, container: ServingContainer,
               rehearsal: RecipeOverlay | None = None) -> ServeUnit:
    exec_argv = container.exec_start(command)
    served = ServedCommand(**command.model_dump(), exec_start_line=exec_start_line(exec_argv),
                           rehearsal=rehearsal)
    files = UnitFiles(env_file=env_file_text(command.env, "Managed by the vllm_serve role: rendered by b70ctl serve "
                                                          "render"),
                      serve_json=served.model_dump_json(indent=2) + "\n",
                      container_json=container.model_dump_json(indent=2) + "\n")
    return ServeUnit(argv=command.argv, env=command.env, docker_args=command.docker_args, exec_start=exec_argv,
                     exec_start_line=exec_start_line(exec_argv), container=container, files=files)


def unit_file_text(recipe_name: str, unit: str, port: int, baseline: bool, user: str, exec_argv: list[str]) -> str:
    """The unit file: systemd starts the container in the foreground, removes a leftover one first and stops it
    with 30 s for vLLM to drain; every value is quoted (systemd_exec_argument) or made one literal line
    (systemd_text)."""
    name = systemd_text(recipe_name)
    return "\n".join([
        "# Managed by the vllm_serve role: rendered by b70ctl serve units.",
        f"# vLLM serving {name}{' (target-only baseline)' if baseline else ''}.",
        "# The arguments and environment come from `b70ctl serve render` (one renderer for every consumer); the",
        "# image's entrypoint (images/entrypoint.sh) starts vLLM with the arguments after the image.",
        "[Unit]",
        f"Description=vLLM {name}{' baseline' if baseline else ''} on port {port}",
        "After=docker.service network-online.target",
        "Requires=docker.service",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"User={systemd_text(user)}",
        f"ExecStartPre=-{DOCKER} rm --force {systemd_exec_argument(unit)}",
        "# docker run with the rendered options, each argument double-quoted and escaped, so systemd reads back",
        "# exactly the value, whatever quote, newline, % or $ it holds.",
        f"ExecStart={exec_start_line(exec_argv)}",
        f"ExecStop={DOCKER} stop --time 30 {systemd_exec_argument(unit)}",
        "Restart=on-failure",
        "RestartSec=10",
        "TimeoutStopSec=60",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        ""])


class HostServer(Document):
    """One server of a host: what the start watcher, the journal reader and a rollback read (unit, port), and the
    two files the role writes for it."""

    unit: str
    port: int = Field(ge=1, le=65535)
    baseline: bool = Field(description="The target-only baseline (no speculation) of the same recipe")
    unit_path: str = Field(description="<systemd dir>/<unit>.service")
    unit_file: str
    env_file_path: str = Field(description="<config_dir>/<unit>.env, the unit's EnvironmentFile=")
    env_file: str
    exec_start_line: str


class HostUnits(Document):
    """`b70ctl serve units --json`: every unit of a host and every file the vllm_serve role writes from them."""

    servers: list[HostServer] = Field(description="The speculative server first, then its baseline if served")
    serve_json: str = Field(description="/etc/b70/serve.json: the speculative server's render")
    container_path: str = Field(description="<config_dir>/<unit>.container.json, read back by b70ctl tune")
    container_json: str
    config_files: list[str] = Field(description="What a rollback puts back: each unit file and environment file")
