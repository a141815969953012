"""A host's serving environment, as a report records it: one mapping from what the appliance leaves on a host
to the report's Environment fields.

The replication_check role gathers, per host, the b70 Ansible fact (GPU inventory from sysfs, b70host/facts.py),
/etc/b70/topology.json (oneCCL profile), /etc/b70/image.json (dspark_image role), /etc/b70/models.json
(model_store role) and the compute runtime's package version, and pipes them here as one bundle; the output is
the host_facts.json that `b70ctl verify --host-facts` and the fleet report read.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

from pydantic import Field, field_validator

from b70ctl.documents import Document
from b70ctl.host.model import FactsDocument
from b70ctl.lock.model import Lock, appliance_hash
from b70ctl.recipes.model import Recipe
from b70ctl.report.model import Environment


class HostBundle(Document):
    """What the role collects on a host; every part may be missing (a host stage that has not run yet)."""

    hostname: str | None = None
    facts: FactsDocument | None = Field(None, description="The b70 fact (b70host/facts.py output)")
    topology: dict[str, Any] = Field(default_factory=dict, description="/etc/b70/topology.json")
    image: dict[str, Any] = Field(default_factory=dict, description="/etc/b70/image.json")
    models: dict[str, Any] = Field(default_factory=dict, description="/etc/b70/models.json")
    compute_runtime: str | None = Field(None, description="Installed version of Intel's Level Zero GPU driver")
    serve: dict[str, Any] = Field(default_factory=dict, description="`b70ctl serve render` output of the measured "
                                                                     "server (/etc/b70/serve.json)")

    @field_validator("facts", mode="before")
    @classmethod
    def _no_facts_yet(cls, value: Any) -> Any:
        """The role sends {} for a host whose gpu_topology stage has not run: no facts, not broken ones."""
        return None if value == {} else value


def _firmware_version(facts: FactsDocument, kind: str) -> str | None:
    """The GuC or HuC (KIND guc or huc) release, naming where it came from: what the driver loaded (debugfs, read
    as root; each distinct version of the GPUs), else the version inside the first present xe firmware file of
    KIND, else that file's name."""
    loaded: list[str] = []
    for gpu in facts.gpus:
        state = getattr(gpu.firmware, kind) if gpu.firmware else None
        if state is not None and state.found_release and state.found_release not in loaded:
            loaded.append(state.found_release)
    if loaded:
        return f"{' / '.join(loaded)} (loaded)"
    for name, entry in sorted(facts.firmware_files.items()):
        if f"_{kind}" in name.rsplit("/", 1)[-1] and entry.present:
            if entry.release_version:
                return f"{entry.release_version} (file)"
            return f"{entry.file or name} (file, version not readable)"
    return None


def hardware_root(facts: FactsDocument) -> str | None:
    """The root prefix the facts were read under when it is not /: the GPUs, kernel and firmware of a fixture."""
    if facts.root is None or os.path.normpath(facts.root) in ("/", "//"):
        return None
    return facts.root


def _revision(models: dict[str, Any], role: str) -> str | None:
    entry = models.get(role)
    return str(entry["revision"]) if isinstance(entry, dict) and entry.get("revision") else None


def serve_command_line(rendered: dict[str, Any]) -> str | None:
    """The rendered server as one shell line a person can read and re-run: env assignments, then the vLLM
    arguments (the API key is never among them: it travels in a file)."""
    argv = rendered.get("argv")
    if not isinstance(argv, list) or not argv:
        return None
    env = rendered.get("env")
    if not isinstance(env, dict):
        env = {}
    assignments = [f"{name}={shlex.quote(str(value))}" for name, value in sorted(env.items())]
    return " ".join([*assignments, "vllm", "serve", *(shlex.quote(str(arg)) for arg in argv)])


def profile_reason(topology: dict[str, Any]) -> str | None:
    """Why the host serves its oneCCL profile, with who chose it: the topology's own rule, the owner's override,
    or the serve gate's fallback after a p2p start died."""
    reason, source = topology.get("profile_reason"), topology.get("profile_source")
    if not reason:
        return None
    return f"{source}: {reason}" if source in ("override", "fallback") else str(reason)


def host_environment(bundle: HostBundle, recipe: Recipe, lock: Lock) -> Environment:
    facts = bundle.facts
    by_model = facts.gpu_count_by_model if facts else {}
    return Environment(
        hostname=bundle.hostname,
        appliance_hash=appliance_hash(recipe, lock),
        image_digest=bundle.image.get("digest") or bundle.image.get("id"),
        vllm_version=bundle.image.get("vllm_version"),
        model_revision=_revision(bundle.models, "target"),
        drafter_revision=_revision(bundle.models, "drafter"),
        kernel=facts.kernel_release if facts else None,
        xe_guc_firmware=_firmware_version(facts, "guc") if facts else None,
        xe_huc_firmware=_firmware_version(facts, "huc") if facts else None,
        compute_runtime=bundle.compute_runtime,
        gpu_count=facts.gpu_count if facts else None,
        gpu_model=", ".join(f"{count}x {name}" for name, count in sorted(by_model.items())) or None,
        p2p_profile=bundle.topology.get("profile"),
        p2p_profile_reason=profile_reason(bundle.topology),
        serve_command=serve_command_line(bundle.serve),
        hardware_root=hardware_root(facts) if facts else None,
    )
