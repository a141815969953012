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
from b70ctl.host_documents import FactsDocument, TopologyDocument
from b70ctl.image.documents import InstalledImage
from b70ctl.lock.model import Lock, appliance_hash
from b70ctl.models.record import ModelsRecord
from b70ctl.recipes.model import Recipe
from b70ctl.report.model import Environment
from b70ctl.serve.rehearsal import RecipeOverlay
from b70ctl.serve.render import ServeCommand
from b70ctl.serve.unit import ServedCommand


class HostBundle(Document):
    """What the role collects on a host (b70host.bundle), each document read with the model of the command that
    wrote it; every part may be missing (a stage that has not run yet: b70host.bundle sends {})."""

    hostname: str | None = None
    facts: FactsDocument | None = Field(None, description="The b70 fact (b70host/facts.py output)")
    topology: TopologyDocument | None = Field(None, description="/etc/b70/topology.json (b70host.topology)")
    image: InstalledImage | None = Field(None, description="/etc/b70/image.json (`b70ctl image record --json`)")
    models: ModelsRecord | None = Field(None, description="/etc/b70/models.json (`b70ctl model record --json`)")
    compute_runtime: str | None = Field(None, description="Installed version of Intel's Level Zero GPU driver")
    serve: ServedCommand | None = Field(None, description="`b70ctl serve render --json` of the measured server "
                                                         "(/etc/b70/serve.json)")

    @field_validator("facts", "topology", "image", "models", "serve", mode="before")
    @classmethod
    def _not_written_yet(cls, value: Any) -> Any:
        """{} is a document its stage has not written yet: nothing, not a broken one."""
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


def serve_command_line(rendered: ServeCommand) -> str | None:
    """The rendered server as one shell line a person can read and re-run: env assignments, then the vLLM
    arguments (the API key is never among them: it travels in a file)."""
    if not rendered.argv:
        return None
    assignments = [f"{name}={shlex.quote(value)}" for name, value in sorted(rendered.env.items())]
    return " ".join([*assignments, "vllm", "serve", *(shlex.quote(arg) for arg in rendered.argv)])


def rehearsal_lines(overlay: RecipeOverlay) -> list[str]:
    """A rehearsal's overlay as the report lists it: what stands in for the weights, then each removed option."""
    return ([f"models: {overlay.models}"] + [f"removed {dropped.option}: {dropped.why}" for dropped in overlay.drop]
            + [f"{changed.option} {changed.value}: {changed.why}" for changed in overlay.replace])


def profile_reason(topology: TopologyDocument) -> str | None:
    """Why the host serves its oneCCL profile, with who chose it: the topology's own rule, the owner's override,
    or the serve gate's fallback after a p2p start died."""
    if not topology.profile_reason:
        return None
    if topology.profile_source in ("override", "fallback"):
        return f"{topology.profile_source}: {topology.profile_reason}"
    return topology.profile_reason


def host_environment(bundle: HostBundle, recipe: Recipe, lock: Lock) -> Environment:
    facts, image, models, topology = bundle.facts, bundle.image, bundle.models, bundle.topology
    by_model = facts.gpu_count_by_model if facts else {}
    return Environment(
        hostname=bundle.hostname,
        appliance_hash=appliance_hash(recipe, lock),
        image_digest=(image.digest or image.id) if image else None,
        vllm_version=image.vllm_version if image else None,
        model_revision=models.target.revision if models else None,
        drafter_revision=models.drafter.revision if models and models.drafter else None,
        kernel=facts.kernel_release if facts else None,
        xe_guc_firmware=_firmware_version(facts, "guc") if facts else None,
        xe_huc_firmware=_firmware_version(facts, "huc") if facts else None,
        compute_runtime=bundle.compute_runtime,
        gpu_count=facts.gpu_count if facts else None,
        gpu_model=", ".join(f"{count}x {name}" for name, count in sorted(by_model.items())) or None,
        p2p_profile=topology.profile if topology else None,
        p2p_profile_reason=profile_reason(topology) if topology else None,
        serve_command=serve_command_line(bundle.serve) if bundle.serve else None,
        serve_exec_start=bundle.serve.exec_start_line if bundle.serve else None,
        serve_prefix_caching=bundle.serve.prefix_caching if bundle.serve else None,
        rehearsal=rehearsal_lines(bundle.serve.rehearsal) if bundle.serve and bundle.serve.rehearsal else None,
        hardware_root=hardware_root(facts) if facts else None,
    )
