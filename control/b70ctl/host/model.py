"""The topology document (/etc/b70/topology.json) as a typed model: how the serving stage reads it.

topology.py writes it with the standard library only (it runs on hosts with just python3); whoever reads it in
b70ctl goes through `load_topology`, so a hand-edited or stale file is refused with the field and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from b70ctl.errors import BadInput
from b70ctl.host.topology import CCL_PROFILES, TOPOLOGY_SCHEMA_VERSION

Profile = Literal["p2p", "no-p2p"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProbeResult(_Model):
    status: Literal["confirmed", "refused", "inconclusive", "not_probed"]
    command: list[str]
    exit_code: int | None
    peak_gb_per_s: float | None
    detail: str


class PairTopology(_Model):
    a: int
    b: int
    a_address: str
    b_address: str
    relation: Literal["same_switch", "separate_root_ports", "separate_host_bridges"]
    common_bridge: str | None
    acs: Literal["off", "redirect", "unknown", "not_applicable"]
    acs_redirect_bridges: list[str]
    acs_unknown_bridges: list[str]
    p2p_from_topology: bool | None
    p2p: bool | None
    reason: str
    probe: ProbeResult | None
    rule: str | None = Field(None, description="The P2PDMA rule that decided (schema 2): same-switch, amd-zen, "
                             "whitelisted-host-bridge:VVVV:DDDD, refused: ..., unknown: ...")


class TopologyGpu(_Model):
    index: int
    level_zero_index: int | None
    pci_address: str
    model: str
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
    auto_profile: Profile
    profile_source: Literal["auto", "override"]
    tensor_parallel_size: int = Field(ge=1)
    group: list[int] = Field(description="Indices (PCI order) of the GPUs the server uses")
    affinity_mask: str = Field(description="ZE_AFFINITY_MASK for the group (Level Zero indices)")
    group_devices: list[str] = Field(description="/dev/dri nodes to pass into the container")
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
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise BadInput(f"topology file {path}: {error.strerror}: run `b70ctl host topology --write` (or the "
                       f"gpu_topology role) on the host first") from error
    except json.JSONDecodeError as error:
        raise BadInput(f"topology file {path}: not JSON ({error.msg}): rewrite it with `b70ctl host topology "
                       f"--write`") from error
    data.pop("changed", None)
    data.pop("path", None)
    try:
        document = TopologyDocument.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        location = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise BadInput(f"topology file {path}: {location}: {first['msg']}: rewrite it with `b70ctl host topology "
                       f"--write`") from error
    if document.ccl_env != CCL_PROFILES[document.profile]["env"]:
        raise BadInput(f"topology file {path}: ccl_env differs from profile {document.profile}'s set: rewrite it "
                       f"with `b70ctl host topology --write`")
    return document
