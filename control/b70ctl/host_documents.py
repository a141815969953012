"""The host's documents as typed models: how b70ctl reads them back. They sit below serve, host and diagnose, all
of which read them, beside the other documents every layer shares.

The topology document (/etc/b70/topology.json) and the facts document (the b70 Ansible fact, `b70ctl host facts
--json`) are written by topology.py and facts.py with the standard library only (they run on hosts with just
python3); whoever reads one in b70ctl goes through `load_topology` or `FactsDocument` (`load_facts`), so a
hand-edited, stale or mistyped file is refused with the field and the fix instead of failing later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from b70ctl.documents import Pinned as _Model
from b70ctl.errors import BadInput, first_problem
from b70ctl.files import read_json_object
from b70host.topology import CCL_PROFILES, TOPOLOGY_SCHEMA_VERSION, PairTopology

Profile = Literal["p2p", "no-p2p"]


class TopologyGpu(_Model):
    index: int
    level_zero_index: int | None
    pci_address: str
    model: str
    pci_id: str | None = None
    host_bridge: str | None
    root_port: str | None
    numa_node: int | None
    card: str | None
    render: str | None
    xe_bound: bool


class ProbeState(_Model):
    tool: str | None
    status: Literal["not_installed", "skipped", "probed", "nothing_to_probe", "available", "init_failed", "failed"]
    detail: str | None = None


class P2pdmaInputs(_Model):
    """What the kernel's P2PDMA rule looked at besides the PCIe tree (schema 2)."""

    cpu_vendor: str | None
    cpu_family: int | None
    amd_zen: bool
    host_bridge_devices: dict[str, str | None]
    whitelist_source: str


class TopologyDocument(_Model):
    schema_version: Literal[1, 2] = TOPOLOGY_SCHEMA_VERSION  # 1: written before pairs named their rule
    profile: Profile
    profile_reason: str | None = Field(None, description="Why this profile: p2p only when a probe opened peer memory "
                                       "between every pair of the group")
    gpu_pci_ids: list[str] = Field(default_factory=list, description="The recipe's PCI ids the group was built from "
                                   "(empty: any Intel discrete GPU)")
    auto_profile: Profile
    profile_source: Literal["auto", "override", "fallback"] = Field(
        description="auto: the topology's own choice; override: the host's b70_ccl_profile; fallback: the serve "
                    "gate's record of a p2p start that died (b70host/topology.py FALLBACK_PATH)")
    fallback: dict[str, Any] | None = Field(None, description="That record, when profile_source is fallback")
    tensor_parallel_size: int = Field(ge=1)
    group: list[int] = Field(description="Indices (PCI order) of the GPUs the server uses")
    affinity_mask: str = Field(description="ZE_AFFINITY_MASK for the group (Level Zero indices)")
    group_devices: list[str] = Field(description="/dev/dri/by-path nodes (pci-<bdf>-card, -render) to pass into "
                                     "the container: DRM minor numbers follow probe order, PCI addresses do not")
    reasons: list[str]
    ccl_env: dict[str, str]
    docker_args: list[str]
    probe: ProbeState
    gpus: list[TopologyGpu]
    pairs: list[PairTopology]
    p2pdma: P2pdmaInputs | None = None

    def serve_env(self) -> dict[str, str]:
        """What the serve renderer adds for this host: the profile's oneCCL set and the device mask."""
        env = dict(CCL_PROFILES[self.profile]["env"])
        if self.affinity_mask:
            # Inside the container Level Zero sees only the group's device nodes (group_devices), numbered from 0:
            # the host's indices (affinity_mask, e.g. "2,3") would select cards the container does not have.
            env["ZE_AFFINITY_MASK"] = ",".join(str(index) for index in range(len(self.group)))
        return env


def load_topology(path: Path) -> TopologyDocument:
    return read_topology(path)[1]


def read_topology(path: Path) -> tuple[dict[str, Any], TopologyDocument]:
    """The topology file as it is written, and validated: a missing, broken, hand-edited or stale file is one
    BadInput line with the fix."""
    where = f"topology file {path}"
    fix = "rewrite it with `b70ctl host topology --write`"
    written = read_json_object(path, where, fix,
                               missing=f"{where}: No such file or directory: run `b70ctl host topology --write` (or "
                                       "the gpu_topology role) on the host first")
    # The topology command's own output (b70host.topology without --document) adds whether and where it wrote.
    data = {key: value for key, value in written.items() if key not in ("changed", "path")}
    try:
        document = TopologyDocument.model_validate(data)
    except ValidationError as error:
        raise BadInput(f"{where}: {first_problem(error)}: {fix}") from error
    if document.ccl_env != CCL_PROFILES[document.profile]["env"]:
        raise BadInput(f"{where}: ccl_env differs from profile {document.profile}'s set: {fix}")
    return written, document


# --- the facts document: the b70 Ansible fact, `b70ctl host facts --json` (facts.py) ---------------------------


class _Facts(BaseModel):
    """Strict: facts.py writes real JSON types, so "64GB" for a byte count or "false" for a flag is a broken file,
    not something to coerce (the string "false" would read as true). Fields b70ctl does not read pass through."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class UcState(_Facts):
    """A GuC or HuC as the driver shows it in debugfs (facts.py parse_uc_info)."""

    status: str | None = None
    found_release: str | None = Field(None, description="The release version of the firmware the driver loaded")


class GpuFirmware(_Facts):
    guc: UcState | None = None
    huc: UcState | None = None


class FactsGpu(_Facts):
    """One discrete GPU as the fit check and the reports read it."""

    pci_address: str
    pci_id: str | None = None
    model: str = "unknown"
    driver: str | None = None
    xe_bound: bool = False
    vram_bytes: int | None = Field(None, ge=0)
    vram_gib_nominal: float | None = Field(None, ge=0)
    firmware: GpuFirmware | None = Field(None, description="From debugfs: only readable as root")


class FirmwareFile(_Facts):
    present: bool = False
    file: str | None = None
    path: str | None = Field(None, description="Where the kernel's firmware loader finds it first (facts.py "
                                               "FIRMWARE_DIRS), /lib/firmware/updates before /lib/firmware")
    release_version: str | None = Field(None, description="The release its header carries (compressed files read "
                                                          "decompressed); null when not readable here")


class FreeSpace(_Facts):
    """facts.py --free-space-of: what preflight asks of the model store's filesystem."""

    path: str
    measured_at: str | None = Field(description="The path itself, or its nearest existing parent before it is "
                                                "created; null for a relative path, which is not measured")
    free_bytes: int | None = Field(ge=0, description="df -P's Available: f_bavail blocks of f_frsize bytes")


class FactsDocument(_Facts):
    """The b70 fact of one host (facts.py `collect_facts`), as read back from a file, stdin or a host bundle."""

    root: str | None = Field(None, description="The root prefix the facts were read under: / on a real host")
    gpus: list[FactsGpu]
    gpu_count: int | None = Field(None, ge=0)
    gpu_count_by_model: dict[str, int] = Field(default_factory=dict)
    kernel_release: str | None = None
    ram_total_bytes: int | None = Field(None, ge=0)
    firmware_files: dict[str, FirmwareFile] = Field(default_factory=dict)
    free_space: FreeSpace | None = Field(None, description="Only when preflight asks (--free-space-of)")


FACTS_FIX = "give the output of `b70ctl host facts --json` (the host's b70 Ansible fact)"


def load_facts(source: str) -> FactsDocument:
    """A host's facts from a file or '-' (stdin): how the controller checks a host it is not on."""
    where = "host facts on stdin" if source == "-" else f"host facts {source}"
    data = read_json_object(source, where, FACTS_FIX)
    try:
        return FactsDocument.model_validate(data)
    except ValidationError as error:
        raise BadInput(f"{where}: {first_problem(error)}: {FACTS_FIX}") from error
