"""The appliance's own systemd unit as the tune's server: each candidate is served by the unit roles/vllm_serve
installed (its User=, ExecStartPre=, ExecStop=, Restart= and container name), with the ExecStart of the same
render (candidate_command / render_container) and the same health gate as the role (/health answers 200, then
/v1/models lists the recipe's served model name, within the role's health timeout).

A candidate is a runtime drop-in, /run/systemd/system/<unit>.service.d/b70-tune.conf, that replaces ExecStart,
and an environment file of its own beside the unit's; the unit file under /etc is never touched. At the end,
however the tune ends (done, a failure, SIGTERM, Ctrl-C), the drop-in and the environment file are removed and
the unit is restarted as it was and health-gated again; the baseline unit stopped for the tune is started again.
A tune killed without a chance to clean up (SIGKILL, power) leaves a drop-in under /run, which a reboot drops
and the next tune removes first.

A race serves other recipes through the same unit. One whose image or models differ from the host recipe's runs the
image and the model store playbooks/tune.yml installed for it beside the host recipe's, as the image and model
stages record them under <etc_dir>/race/<recipe>/ (RacedInstall); the unit's own image and store stay as they are.

The host's commands go through a HostShell: over SSH from the controller (SshShell, the same account and key as
Ansible's connection), where b70ctl and the reports live, as for verify.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath
from types import TracebackType
from typing import Any, Literal, Protocol

import httpx
from pydantic import Field, ValidationError, model_validator

from b70ctl.checks.client import Endpoint
from b70ctl.documents import Document
from b70ctl.errors import BadInput, HostFailed, Unreachable, first_problem
from b70ctl.host_documents import TopologyDocument
from b70ctl.image.documents import InstalledImage
from b70ctl.models.record import ModelsRecord
from b70ctl.recipes.model import Recipe
from b70ctl.report.model import RooflineInputs
from b70ctl.serve.render import ServeCommand, render_container
from b70ctl.serve.unit import CONTAINER_MODELS_DIR, ServingContainer, env_file_text, exec_start_line
from b70ctl.tune.model import Candidate
from b70ctl.tune.serving import CandidateFailed, CandidateServers, candidate_command, server_name

DROP_IN_NAME = "b70-tune.conf"
CONTAINER_DOCUMENT_SUFFIX = ".container.json"
# <etc_dir>/race/<recipe>/: a raced recipe's image.json, models.json and roofline_inputs.json, which
# playbooks/tune.yml writes with the image and model stages' own roles (roles/vllm_serve/tasks/race_install.yml).
RACE_DIR = "race"
RACE_DOCUMENTS = ("image.json", "models.json", "roofline_inputs.json")


class HostCommandFailed(HostFailed):
    """A command on the host exited non-zero: exit 2 with its last line, unless the tune can go on without it."""

    def __init__(self, argv: list[str], detail: str):
        super().__init__(f"{shlex.join(argv)}: {detail}")
        self.argv, self.detail = argv, detail


class HostShell(Protocol):
    def run(self, argv: list[str], stdin: str | None = None) -> str:
        """Run argv on the host (as root), return its stdout; HostCommandFailed when it exits non-zero."""
        ...


def _completed(argv: list[str], completed: subprocess.CompletedProcess[str]) -> str:
    if completed.returncode != 0:
        detail = (completed.stderr.strip().splitlines() or [f"exit {completed.returncode}"])[-1]
        raise HostCommandFailed(argv, detail[:300])
    return completed.stdout


class LocalShell:
    """This machine is the host (ansible_connection=local): through sudo -n unless b70ctl runs as root."""

    def __init__(self, timeout_s: float = 120.0, become: bool = True):
        self.timeout_s = timeout_s
        self.sudo = ["sudo", "-n", "--"] if become and os.geteuid() != 0 else []

    def run(self, argv: list[str], stdin: str | None = None) -> str:
        argv = [*self.sudo, *argv]
        try:
            completed = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise HostCommandFailed(argv, str(error)) from error
        return _completed(argv, completed)


# Ansible's connection variables, by the name the inventory sets them under, and the field each fills. The
# playbook passes them as Ansible has them (null when unset), so what a value means is decided here, once.
ANSIBLE_CONNECTION_VARIABLES = {
    "ansible_connection": "connection",
    "ansible_host": "address",
    "ansible_port": "ssh_port",
    "ansible_user": "ssh_user",
    "ansible_ssh_private_key_file": "ssh_private_key",
    "ansible_ssh_common_args": "ssh_common_args",
    "ansible_ssh_extra_args": "ssh_extra_args",
}
# The connection plugins that run commands on the controller itself; every other one is reached over ssh.
LOCAL_CONNECTIONS = frozenset({"local", "ansible.builtin.local", "ansible.legacy.local"})


class ApplianceHost(Document):
    """The host a tune owns the unit of, as playbooks/tune.yml hands it over (stdin of `b70ctl tune --host -`):
    how to reach it (Ansible's connection settings, under these names or Ansible's own) and the vllm_serve role's
    settings of its unit."""

    name: str = Field(description="inventory_hostname")
    connection: Literal["ssh", "local"] = Field("ssh", description="ansible_connection: local when the controller "
                                                                    "is the host")
    address: str = Field(description="ansible_host (else the name): where SSH and the served port are reached")
    ssh_port: int = Field(22, ge=1, le=65535)
    ssh_user: str | None = Field(None, description="ansible_user; None: ssh's own default")
    ssh_private_key: str | None = Field(None, description="ansible_ssh_private_key_file")
    ssh_common_args: str = Field("", description="ansible_ssh_common_args, split like a shell line")
    ssh_extra_args: str = Field("", description="ansible_ssh_extra_args, after the common ones, as Ansible does")
    become: bool = Field(True, description="Run the host's commands through sudo -n when the user is not root")
    unit: str = Field("b70-vllm", pattern=r"^[A-Za-z0-9:_.@-]+$", description="vllm_serve_unit")
    port: int = Field(8000, ge=1, le=65535, description="vllm_serve_port")
    config_dir: str = Field("/etc/b70/serve", description="vllm_serve_config_dir")
    etc_dir: str = Field("/etc/b70", description="b70_etc_dir (topology.json)")
    baseline_unit: str | None = Field(None, pattern=r"^[A-Za-z0-9:_.@-]+$",
                                      description="The baseline server's unit, stopped while the tune measures")
    api_key: str | None = Field(None, repr=False, description="vllm_serve_api_key (secret)")
    health_timeout_s: float = Field(900.0, gt=0, description="vllm_serve_health_timeout")

    @model_validator(mode="before")
    @classmethod
    def _ansible_connection_variables(cls, data: Any) -> Any:
        """Ansible's variables fill the fields they name; null is "not set in the inventory" (the field's default,
        the address the inventory name); any connection plugin but local is reached over ssh."""
        if not isinstance(data, dict):
            return data
        fields = {key: value for key, value in data.items() if key not in ANSIBLE_CONNECTION_VARIABLES}
        for variable, field in ANSIBLE_CONNECTION_VARIABLES.items():
            if data.get(variable) is None:
                continue
            if field in fields:
                raise ValueError(f"{variable} and {field} both given: pass one of them")
            value = data[variable]
            if field == "connection":
                value = "local" if value in LOCAL_CONNECTIONS else "ssh"
            fields[field] = value
        if "address" not in fields and "name" in fields:
            fields["address"] = fields["name"]
        return fields


def host_shell(host: ApplianceHost) -> HostShell:
    return LocalShell(become=host.become) if host.connection == "local" else SshShell(host)


class SshShell:
    """The host over SSH, with the connection settings Ansible uses for it."""

    def __init__(self, host: ApplianceHost, timeout_s: float = 120.0):
        self.host, self.timeout_s = host, timeout_s

    def ssh_argv(self, argv: list[str]) -> list[str]:
        host = self.host
        options = ["-o", "BatchMode=yes", "-p", str(host.ssh_port)]
        if host.ssh_private_key:
            options += ["-i", host.ssh_private_key]
        # The common arguments, then the extra ones: the order of ansible-core's ssh plugin (_build_command).
        options += shlex.split(host.ssh_common_args) + shlex.split(host.ssh_extra_args)
        destination = f"{host.ssh_user}@{host.address}" if host.ssh_user else host.address
        if host.become and host.ssh_user not in (None, "root"):
            argv = ["sudo", "-n", "--", *argv]
        return ["ssh", *options, "--", destination, shlex.join(argv)]

    def run(self, argv: list[str], stdin: str | None = None) -> str:
        command = self.ssh_argv(argv)
        try:
            completed = subprocess.run(command, input=stdin if stdin is not None else "", capture_output=True,
                                       text=True, timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise HostCommandFailed(argv, str(error)) from error
        if completed.returncode == 255:
            raise Unreachable(f"{self.host.name}: SSH to {self.host.address}:{self.host.ssh_port} failed: "
                           f"{(completed.stderr.strip().splitlines() or ['no message'])[-1][:300]}: check the "
                           "inventory's connection settings (ansible -m ping)")
        return _completed(argv, completed)


def drop_in_text(label: str, exec_argv: list[str]) -> str:
    """The runtime drop-in serving one candidate: ExecStart emptied, then the candidate's."""
    shown = " ".join(label.split()).replace("%", "%%")
    return (f"# b70ctl tune is serving {shown} through this unit; the drop-in goes when the tune ends, or at reboot.\n"
            "[Service]\nExecStart=\nExecStart=" + exec_start_line(exec_argv) + "\n")


def health_gate(base_url: str, model: str, api_key: str | None, timeout_s: float, poll_s: float = 5.0,
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                died: Callable[[], str | None] | None = None) -> None:
    """The role's gate: /health answers 200, then /v1/models lists the served model. CandidateFailed on time out,
    or as soon as DIED says the server died (the role's gate stops at the first death too: a unit with
    Restart=on-failure would otherwise be restarted again and again until the timeout)."""
    deadline = clock() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    last = "no answer"
    while True:
        try:
            health = httpx.get(f"{base_url}/health", timeout=5)
            if health.status_code == 200:
                listed = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=10)
                names = [entry.get("id") for entry in listed.json().get("data", [])] if listed.status_code == 200 \
                    else []
                if model in names:
                    return
                last = (f"/v1/models answered {listed.status_code} without {model}" if listed.status_code == 200
                        else f"/v1/models answered {listed.status_code}")
            else:
                last = f"/health answered {health.status_code}"
        except (httpx.HTTPError, ValueError, AttributeError) as error:
            last = f"no answer ({type(error).__name__})"
        if died is not None and (death := died()) is not None:
            raise CandidateFailed(f"{death} before it was healthy ({last})")
        if clock() >= deadline:
            raise CandidateFailed(f"not healthy within {timeout_s:.0f} s: {last}")
        sleep(poll_s)


class SystemdUnitServing:
    """CandidateServers over the appliance's unit. Use as a context manager: entering reads what the role
    recorded and stops the baseline unit; leaving puts the unit back as it was, whatever ended the tune."""

    def __init__(self, recipe: Recipe, host: ApplianceHost, shell: HostShell,
                 progress: Callable[[str], None] | None = None, request_timeout_s: float = 120.0,
                 poll_s: float = 5.0):
        self.recipe, self.host, self.shell = recipe, host, shell
        self.progress = progress or (lambda _message: None)
        self.request_timeout_s, self.poll_s = request_timeout_s, poll_s
        self.container: ServingContainer | None = None
        self.topology: TopologyDocument | None = None
        self.was_active = False
        self.stopped_baseline = False
        self.started = 0
        unit = PurePosixPath("/run/systemd/system") / f"{host.unit}.service.d"
        self.drop_in_dir, self.drop_in = str(unit), str(unit / DROP_IN_NAME)
        self.env_file = str(PurePosixPath(host.config_dir) / f"{host.unit}.tune.env")

    # -- the host -------------------------------------------------------------------------------------------

    def _read_json(self, path: str, what: str) -> dict[str, Any]:
        try:
            text = self.shell.run(["cat", path])
            document = json.loads(text)
        except HostCommandFailed as error:
            raise BadInput(f"{self.host.name}: {path} could not be read ({error.detail}): {what}") from error
        except json.JSONDecodeError as error:
            raise BadInput(f"{self.host.name}: {path} is not JSON: {what}") from error
        if not isinstance(document, dict):
            raise BadInput(f"{self.host.name}: {path} is not a JSON object: {what}")
        return document

    def _is_active(self, unit: str) -> bool:
        try:
            return self.shell.run(["systemctl", "is-active", f"{unit}.service"]).strip() == "active"
        except HostCommandFailed:
            return False

    def _systemctl(self, *arguments: str) -> None:
        self.shell.run(["systemctl", *arguments])

    def _restarts(self, unit: str) -> tuple[int, str]:
        """How many times systemd has restarted UNIT since it was loaded, and its sub-state ("running",
        "auto-restart" while it waits RestartSec after a death, "failed" when it gave up); (0, "") unreadable."""
        try:
            shown = self.shell.run(["systemctl", "show", "--property=NRestarts,SubState", f"{unit}.service"])
        except HostCommandFailed:
            return 0, ""
        values = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
        restarts = values.get("NRestarts", "0")
        return (int(restarts) if restarts.isdigit() else 0), values.get("SubState", "")

    def _death_watch(self, unit: str) -> Callable[[], str | None]:
        """DIED for health_gate, made right after a `systemctl restart` (which sets NRestarts back to 0): the
        server's container exited since (systemd restarted it, waits RestartSec to, or gave up on it)."""
        before, _ = self._restarts(unit)

        def died() -> str | None:
            restarts, state = self._restarts(unit)
            if restarts > before or state in ("auto-restart", "failed"):
                return f"{unit}'s server exited (systemd: {state or 'restarted'}, {restarts} restarts)"
            return None

        return died

    def _write(self, path: str, text: str, mode: str) -> None:
        # Written beside, then renamed: systemd and docker never read half a file.
        self.shell.run(["sh", "-c", 'umask 077 && cat > "$1.new" && chmod "$2" "$1.new" && mv -f "$1.new" "$1"',
                        "b70-tune-write", path, mode], stdin=text)

    def _remove_drop_in(self) -> None:
        self.shell.run(["rm", "-f", self.drop_in, self.env_file])
        self._systemctl("daemon-reload")

    def __enter__(self) -> SystemdUnitServing:
        path = str(PurePosixPath(self.host.config_dir) / f"{self.host.unit}{CONTAINER_DOCUMENT_SUFFIX}")
        again = "run the serving stage (playbooks/serve.yml) on this host before tuning it"
        try:
            self.container = ServingContainer.model_validate(self._read_json(path, again))
        except ValidationError as error:
            raise BadInput(f"{self.host.name}: {path}: {first_problem(error)}: {again}") from error
        if self.recipe.host.accelerator == "xpu":
            topology = str(PurePosixPath(self.host.etc_dir) / "topology.json")
            try:
                self.topology = TopologyDocument.model_validate(self._read_json(topology, again))
            except ValidationError as error:
                raise BadInput(f"{self.host.name}: {topology}: {first_problem(error)}: {again}") from error
        # A drop-in left by a tune killed outright is removed first: the unit is what the role installed.
        self._remove_drop_in()
        self.was_active = self._is_active(self.host.unit)
        if self.host.baseline_unit and self._is_active(self.host.baseline_unit):
            self.progress(f"stopping {self.host.baseline_unit} while the tune measures (started again at the end)")
            self._systemctl("stop", f"{self.host.baseline_unit}.service")
            self.stopped_baseline = True
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        deferred = _defer_sigterm()
        try:
            self.restore(raise_on_failure=error is None)
        finally:
            if deferred.release() and error is None:
                from b70ctl.stops import Terminated

                raise Terminated()

    def restore(self, raise_on_failure: bool = True) -> None:
        """The unit as the role installed it: drop-in and candidate environment removed, restarted and
        health-gated when it was running before the tune (stopped otherwise); the baseline unit started again."""
        unit = f"{self.host.unit}.service"
        problems = []
        try:
            self._remove_drop_in()
            if self.was_active:
                self.progress(f"restoring {self.host.unit} as the serving stage installed it")
                self._systemctl("restart", unit)
                watch = self._death_watch(self.host.unit)
                health_gate(self.base_url, self.recipe.serve.served_model_name, self.host.api_key,
                            self.host.health_timeout_s, self.poll_s, died=watch)
            else:
                self._systemctl("stop", unit)
        except (HostCommandFailed, CandidateFailed) as failure:
            problems.append(f"{self.host.unit}: {failure}")
        if self.stopped_baseline and self.host.baseline_unit:
            try:
                self._systemctl("start", f"{self.host.baseline_unit}.service")
            except HostCommandFailed as failure:
                problems.append(f"{self.host.baseline_unit}: {failure}")
        if problems:
            message = (f"{self.host.name}: the serving unit was not restored: {'; '.join(problems)}: run "
                       "playbooks/serve.yml on this host")
            self.progress(message)
            if raise_on_failure:
                raise BadInput(message)
        elif self.was_active:
            self.progress(f"{self.host.unit} restored and healthy")

    # -- CandidateServers -----------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        address = f"[{self.host.address}]" if ":" in self.host.address else self.host.address
        return f"http://{address}:{self.host.port}"

    @property
    def profile(self) -> str | None:
        """The host's oneCCL profile (from topology.json): the tune space's thresholds are this profile's."""
        return self.topology.profile if self.topology is not None else None

    def _own_container(self) -> ServingContainer:
        assert self.container is not None, "use SystemdUnitServing as a context manager"
        return self.container

    def _serve(self, label: str, command: ServeCommand, recipe: Recipe, container: ServingContainer
               ) -> Iterator[Endpoint]:
        served_name = recipe.serve.served_model_name
        exec_argv = container.exec_start(command, env_file=self.env_file)
        # 0644 like the role's: the docker CLI reads it as the unit's User= (the API key has a file of its own).
        self._write(self.env_file, env_file_text(command.env, "b70ctl tune: the candidate's environment"), "0644")
        self.shell.run(["mkdir", "-p", self.drop_in_dir])
        self._write(self.drop_in, drop_in_text(label, exec_argv), "0644")
        self._systemctl("daemon-reload")
        self.started += 1
        self.progress(f"serving {label} through {self.host.unit} on {self.host.name}")
        try:
            self._systemctl("restart", f"{self.host.unit}.service")
        except HostCommandFailed as failed:
            raise CandidateFailed(f"systemctl restart failed: {failed.detail}; {self._last_log_line()}") from None
        watch = self._death_watch(self.host.unit)
        try:
            health_gate(self.base_url, served_name, self.host.api_key, self.host.health_timeout_s, self.poll_s,
                        died=watch)
        except CandidateFailed as failed:
            raise CandidateFailed(f"{failed.reason}; {self._last_log_line()}") from None
        yield Endpoint(self.base_url, model=served_name, api_key=self.host.api_key, timeout_s=self.request_timeout_s)

    def _last_log_line(self) -> str:
        try:
            lines = self.shell.run(["journalctl", "--unit", f"{self.host.unit}.service", "--lines", "200",
                                    "--no-pager", "--output", "cat"]).splitlines()
        except HostCommandFailed:
            return "no journal"
        errors = [line for line in lines if "Error" in line or "Exception" in line]
        return "last log line: " + ((errors or lines or ["empty journal"])[-1].strip()[:300])

    @contextmanager
    def baseline(self) -> Iterator[Endpoint]:
        yield from self._baseline(self.recipe, self._own_container())

    @contextmanager
    def candidate(self, candidate: Candidate) -> Iterator[Endpoint]:
        yield from self._candidate(self.recipe, candidate, self._own_container())

    def _baseline(self, recipe: Recipe, container: ServingContainer) -> Iterator[Endpoint]:
        command = render_container(recipe, container.context(speculative=False), self.topology)
        try:
            yield from self._serve("the target-only baseline" + ("" if recipe is self.recipe else
                                                                 f" of {recipe.name}"), command, recipe, container)
        except CandidateFailed as failed:
            raise BadInput(f"{self.host.name}: the target-only baseline did not start: {failed.reason}") from None

    def _candidate(self, recipe: Recipe, candidate: Candidate, container: ServingContainer) -> Iterator[Endpoint]:
        try:
            command = candidate_command(recipe, candidate, container.context(speculative=True), self.topology)
        except ValueError as error:
            raise CandidateFailed(f"not renderable: {error}") from error
        yield from self._serve(server_name(candidate), command, recipe, container)

    def serving_of(self, recipe: Recipe) -> CandidateServers:
        """Another raced recipe served through the same unit. With the image and models playbooks/tune.yml
        installed for it (<etc_dir>/race/<recipe>/), it runs those; without them, only a recipe sharing the host
        recipe's image, target and drafter can run (on the unit's own), and any other is refused here, before
        anything is stopped or started."""
        if recipe.name == self.recipe.name:
            return self
        installed = self.raced_install(recipe)
        if installed is not None:
            return RacedRecipe(self, recipe, installed)
        problems = []
        if recipe.image != self.recipe.image:
            problems.append(f"image {recipe.image.reference}:{recipe.image.tag} (the unit serves "
                            f"{self.recipe.image.reference}:{self.recipe.image.tag})")
        if recipe.target != self.recipe.target:
            problems.append("another target model")
        if recipe.drafter is not None and recipe.drafter != self.recipe.drafter:
            problems.append("another drafter")
        if problems:
            raise BadInput(f"--recipe {recipe.name} needs {' and '.join(problems)}, and {self.host.name} holds no "
                           f"{self.race_dir(recipe)}/: race it with playbooks/tune.yml (b70_tune_recipes), which "
                           "installs each raced recipe's image and models first")
        return RacedRecipe(self, recipe, None)

    def race_dir(self, recipe: Recipe) -> str:
        return str(PurePosixPath(self.host.etc_dir) / RACE_DIR / recipe.name)

    def raced_install(self, recipe: Recipe) -> RacedInstall | None:
        """What playbooks/tune.yml installed on the host for RECIPE (None when it installed nothing for it)."""
        directory = self.race_dir(recipe)
        try:
            present = self.shell.run(["ls", "-1", directory]).split()
        except HostCommandFailed:
            return None
        again = f"run playbooks/tune.yml with {recipe.name} in b70_tune_recipes again, which installs it"
        missing = [name for name in RACE_DOCUMENTS[:2] if name not in present]
        if missing:
            raise BadInput(f"{self.host.name}: {directory}/ holds no {' or '.join(missing)}: {again}")
        try:
            image = InstalledImage.model_validate(self._read_json(f"{directory}/image.json", again))
            models = ModelsRecord.model_validate(self._read_json(f"{directory}/models.json", again))
        except ValidationError as error:
            raise BadInput(f"{self.host.name}: {directory}: {first_problem(error)}: {again}") from error
        if image.recipe != recipe.name:
            raise BadInput(f"{self.host.name}: {directory}/image.json is recipe {image.recipe}'s image, not "
                           f"{recipe.name}'s: {again}")
        if recipe.drafter is not None and models.drafter is None:
            raise BadInput(f"{self.host.name}: {directory}/models.json holds no drafter, and {recipe.name} has one: "
                           f"{again}")
        roofline = None
        if RACE_DOCUMENTS[2] in present:
            try:
                roofline = RooflineInputs.model_validate(
                    self._read_json(f"{directory}/{RACE_DOCUMENTS[2]}", again))
            except (BadInput, ValidationError) as error:
                self.progress(f"{recipe.name}: {directory}/{RACE_DOCUMENTS[2]} is not usable ({error}): its roofline "
                              "is not measured")
        return RacedInstall(image_id=image.id, models=models, roofline_inputs=roofline)

class RacedInstall:
    """A raced recipe's image and model store on the host, beside the host recipe's (serving_of)."""

    def __init__(self, image_id: str, models: ModelsRecord, roofline_inputs: RooflineInputs | None):
        self.image_id, self.models, self.roofline_inputs = image_id, models, roofline_inputs

    def container(self, unit: ServingContainer) -> ServingContainer:
        """The unit's container (its name, port, environment and key files, caches) running this image over this
        store: what a candidate of the raced recipe runs."""
        target, drafter = self.models.in_container(CONTAINER_MODELS_DIR)
        return unit.model_copy(update={"image": self.image_id, "models_dir": self.models.store_dir(),
                                       "models_label": self.models.label(), "model_dir": target,
                                       "drafter_dir": drafter})


class RacedRecipe:
    """CandidateServers for a raced recipe over the host recipe's SystemdUnitServing (see serving_of)."""

    def __init__(self, unit: SystemdUnitServing, recipe: Recipe, installed: RacedInstall | None):
        self.unit, self.recipe, self.installed = unit, recipe, installed

    @property
    def roofline_inputs(self) -> RooflineInputs | None:
        """The roofline inputs read on the host for this recipe's own target (None on the unit's own models,
        whose inputs are the host recipe's)."""
        return self.installed.roofline_inputs if self.installed is not None else None

    def _container(self) -> ServingContainer:
        assert self.unit.container is not None, "use SystemdUnitServing as a context manager"
        return self.unit.container if self.installed is None else self.installed.container(self.unit.container)

    @contextmanager
    def baseline(self) -> Iterator[Endpoint]:
        yield from self.unit._baseline(self.recipe, self._container())

    @contextmanager
    def candidate(self, candidate: Candidate) -> Iterator[Endpoint]:
        yield from self.unit._candidate(self.recipe, candidate, self._container())


class _DeferredSigterm:
    def __init__(self) -> None:
        self.received = False
        self.previous: object = None
        self.installed = threading.current_thread() is threading.main_thread()
        if self.installed:
            self.previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, _signum: int, _frame: object) -> None:
        self.received = True

    def release(self) -> bool:
        if self.installed:
            signal.signal(signal.SIGTERM, self.previous)  # type: ignore[arg-type]
        return self.received


def _defer_sigterm() -> _DeferredSigterm:
    """A SIGTERM while the unit is being restored waits until it is restored, then ends the tune."""
    return _DeferredSigterm()
