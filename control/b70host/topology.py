#!/usr/bin/env python3
"""PCIe peer-to-peer between the host's GPUs, and the oneCCL profile that follows from it.

Per GPU pair, from the PCIe tree in the facts (facts.py):
- same_switch: both cards sit below one PCIe switch under one root port. P2P is possible when no bridge on the
  way from either card up to that switch redirects peer requests (ACS RR/CR/EC off); with ACS redirect on, the
  traffic goes to the root complex instead; when ACS is not readable (not root) the answer is unknown.
- separate_root_ports / separate_host_bridges: the traffic crosses the root complex.
Whether the kernel lets it is P2PDMA's rule (drivers/pci/p2pdma.c, calc_map_type_and_dist): no ACS redirect up to
a shared switch -> allowed ("same-switch"); otherwise through the host bridge, allowed on any AMD Zen CPU
(cpu_supports_p2pdma: AuthenticAMD, family >= 0x17: "amd-zen") or when both host bridges' root-bus device is in
P2PDMA_HOST_BRIDGE_WHITELIST ("whitelisted-host-bridge:VVVV:DDDD"); else refused. Each pair names its rule.
The Level Zero loader (level_zero.py: zeDeviceCanAccessPeer and zeDeviceGetP2PProperties, as oneCCL asks it), where
installed, confirms or refutes a pair: the runtime's answer beats the inference. Not installed means not probed.

Profile: `p2p` (the recipe's oneCCL set with CCL_TOPO_P2P_ACCESS=1) only when every pair of the tensor-parallel
group is proven: a probe opened the peer's memory (Probe.peer_memory_opened). Neither the kernel's P2PDMA rule nor
zeDeviceCanAccessPeer predicts oneCCL's IPC path: an X870 (AMD) host measured 28.5 GB/s with ze_peer while X570
(AMD) dual-B70 hosts died at zeMemOpenIpcHandle (https://github.com/intel/llm-scaler/issues/618,
https://github.com/SergiioB/intel-arc-pro-b70-inference-cookbook/issues/8). Otherwise `no-p2p` (the
SIMPLE_THRESHOLD fallback confirmed on dual B70); `profile_reason` says which and why. The host may override it
(`--profile`, Ansible var) once ze_peer has passed on it. CCL_PROFILES below is the one place the profiles' env vars and
docker flags are written; the serve renderer reads it (or the copy written into /etc/b70/topology.json).

Standard library only, like the rest of the b70host package: it runs on a host with just python3.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal

from b70host import Refused, level_zero
from b70host.facts import collect_facts


class TopologyRefused(Refused):
    """Nothing was written: one line and exit 2 (a Refused, as b70ctl's entry point reports it; main() below when
    run on a host)."""

# 2: each pair names the P2PDMA rule that decided it; the document records the CPU and host bridges it used.
# Later additions (profile_reason, gpu_pci_ids, a probe's peer_memory_opened) are optional fields of schema 2.
TOPOLOGY_SCHEMA_VERSION: Final = 2
TOPOLOGY_PATH = "/etc/b70/topology.json"
# The serve gate's record of a p2p start that died opening the peer's memory (roles/vllm_serve): while it names
# the group's cards, the group gets no-p2p whatever the kernel's rule, a probe or an override says.
FALLBACK_PATH = "/etc/b70/ccl-fallback.json"
FALLBACK_SCHEMA_VERSION: Final = 1
PROFILES = ("p2p", "no-p2p")
PROFILE_CHOICES = ("auto",) + PROFILES

# The kernel's P2PDMA host bridge whitelist: pci_p2pdma_whitelist[] in drivers/pci/p2pdma.c, read at the PCI
# maintainers' tree (git.kernel.org pci/pci.git, mirror kernelorg-mirror/linux_kernel_git_pci_pci) commit
# cd2698d76c314209662455f419754a5bb7900ad2 (after v7.0; mainline's list up to 0x09a2 has been unchanged since
# v5.12). Named ids resolved from include/linux/pci_ids.h and the drivers that defined them before
# (drivers/dma/idxd/registers.h: DSA_SPR0 0x0b25, IAX_SPR0 0x0cfe, DSA_GNRD 0x11fb, DSA_DMR 0x1212, IAA_DMR 0x1216;
# drivers/crypto/intel/qat/qat_common/adf_accel_devices.h: QAT_4XXX 0x4940, 401XX 0x4942, 402XX 0x4944,
# 420XX 0x4946, 6XXX 0x4948). (vendor, device or None for any, needs both devices on the same host bridge, name)
P2PDMA_WHITELIST_SOURCE = "drivers/pci/p2pdma.c pci_p2pdma_whitelist[] at pci/pci.git cd2698d76c31"
P2PDMA_HOST_BRIDGE_WHITELIST: tuple[tuple[int, int | None, bool, str], ...] = (
    (0x8086, 0x3C00, True, "Intel Xeon E5/Core i7"),
    (0x8086, 0x3C01, True, "Intel Xeon E5/Core i7"),
    (0x8086, 0x2F00, True, "Intel Xeon E7 v3/Xeon E5 v3/Core i7"),
    (0x8086, 0x2F01, True, "Intel Xeon E7 v3/Xeon E5 v3/Core i7"),
    (0x8086, 0x2030, False, "Intel Skylake-E"),
    (0x8086, 0x2031, False, "Intel Skylake-E"),
    (0x8086, 0x2032, False, "Intel Skylake-E"),
    (0x8086, 0x2033, False, "Intel Skylake-E"),
    (0x8086, 0x2020, False, "Intel Skylake-E"),
    (0x8086, 0x09A2, False, "Intel Skylake-E list (Ice Lake-SP)"),
    (0x8086, 0x0B25, False, "Intel DSA_SPR0"),
    (0x8086, 0x0CFE, False, "Intel IAX_SPR0"),
    (0x8086, 0x11FB, False, "Intel DSA_GNRD"),
    (0x8086, 0x1212, False, "Intel DSA_DMR"),
    (0x8086, 0x1216, False, "Intel IAA_DMR"),
    (0x8086, 0x4940, False, "Intel QAT_4XXX"),
    (0x8086, 0x4942, False, "Intel QAT_401XX"),
    (0x8086, 0x4944, False, "Intel QAT_402XX"),
    (0x8086, 0x4946, False, "Intel QAT_420XX"),
    (0x8086, 0x4948, False, "Intel QAT_6XXX"),
    (0x1AE0, None, False, "Google SoCs"),
    (0x10DE, 0x2F95, False, "Nvidia CPUs"),
    (0x10DE, 0x2F96, False, "Nvidia CPUs"),
    (0x10DE, 0x2F97, False, "Nvidia CPUs"),
    (0x10DE, 0x2F98, False, "Nvidia CPUs"),
    (0x1D17, 0x1003, True, "Zhaoxin"),
    (0x1D17, 0x1005, True, "Zhaoxin"),
    (0x1D17, 0x1006, True, "Zhaoxin"),
    (0x1D17, 0x1007, True, "Zhaoxin"),
    (0x1D17, 0x1008, False, "Zhaoxin"),
)
# cpu_supports_p2pdma() in the same file: any AMD CPU of family 0x17 (Zen) or newer.
AMD_VENDOR_ID = "AuthenticAMD"
AMD_ZEN_FAMILY_MIN = 0x17

# The oneCCL profiles: the single source of these env vars and docker flags (docs/facts.md, "P2P and the
# no-P2P path"). `p2p` is the PR #620 recipe's set; `no-p2p` is the fallback confirmed on dual B70 without P2P
# (CCL_TOPO_P2P_ACCESS=0 alone still failed with zeMemOpenIpcHandle errors in several reports).
CCL_PROFILES: dict[str, dict[str, Any]] = {
    "p2p": {
        "description": "GPUs share a PCIe switch with ACS redirect off: oneCCL uses peer access over PCIe",
        "env": {
            "CCL_TOPO_P2P_ACCESS": "1",
            "CCL_ZE_IPC_EXCHANGE": "drmfd",
            "CCL_SYCL_ALLGATHERV_TMP_BUF": "0",
            "CCL_SYCL_ALLREDUCE_TMP_BUF": "0",
            "CCL_ENABLE_SYCL_KERNELS": "1",
            "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD": "131072",
            "CCL_SYCL_ALLGATHERV_SCALEOUT_THRESHOLD": "1048576",
        },
        "docker_args": ["--ipc=host"],
    },
    "no-p2p": {
        "description": "no PCIe peer access between the GPUs: collectives through host memory (simple algorithms)",
        "env": {
            "CCL_TOPO_P2P_ACCESS": "0",
            "CCL_SYCL_ALLREDUCE_SIMPLE_THRESHOLD": "4294967296",
            "CCL_SYCL_REDUCE_SCATTER_SIMPLE_THRESHOLD": "4294967296",
            "CCL_SYCL_ALLGATHERV_SIMPLE_THRESHOLD": "4294967296",
            "CCL_SYCL_ALLTOALL_TMP_BUF": "1",
        },
        "docker_args": ["--cap-add", "SYS_PTRACE", "--ipc=host"],
    },
}


# The document's shapes (Probe, PairTopology) are declared once, here: b70ctl reads topology.json back through
# these classes (b70ctl.host_documents validates a pair as PairTopology), and __pydantic_config__ is how it is told to
# refuse a key the writer never writes. A plain dict, so this module stays standard library only.
_DOCUMENT_CONFIG = {"extra": "forbid"}
ProbeStatus = Literal["confirmed", "refused", "inconclusive", "not_probed"]
Relation = Literal["same_switch", "separate_root_ports", "separate_host_bridges"]
Acs = Literal["off", "redirect", "unknown", "not_applicable"]


@dataclass
class Probe:
    """The Level Zero loader's answer for one pair (both directions)."""

    __pydantic_config__ = _DOCUMENT_CONFIG

    status: ProbeStatus
    command: list[str] = field(default_factory=list)
    exit_code: int | None = None
    peak_gb_per_s: float | None = None
    detail: str = ""
    # True only when the probe opened memory of one device from the other (what oneCCL's IPC path does); a
    # zeDeviceCanAccessPeer answer alone leaves it False.
    peer_memory_opened: bool = False


@dataclass
class PairTopology:
    __pydantic_config__ = _DOCUMENT_CONFIG

    a: int
    b: int
    a_address: str
    b_address: str
    relation: Relation
    common_bridge: str | None
    acs: Acs
    acs_redirect_bridges: list[str]
    acs_unknown_bridges: list[str]
    p2p_from_topology: bool | None
    p2p: bool | None
    reason: str
    probe: Probe | None = None
    # the P2PDMA rule that decided: same-switch | amd-zen | whitelisted-host-bridge:V:D | refused: .. | unknown: ..
    # (None only in a schema-1 document, written before pairs named their rule)
    rule: str | None = None


@dataclass
class TopologyDecision:
    profile: str
    auto_profile: str
    profile_source: str  # auto | override
    tensor_parallel_size: int
    group: list[int]
    affinity_mask: str
    reasons: list[str]
    profile_reason: str = ""


# ---------------------------------------------------------------- pure: pairs

def _bridge_chain(gpu: dict[str, Any]) -> list[dict[str, Any]]:
    return list(gpu.get("parent_bridges") or [])


def cpu_supports_p2pdma(cpu: dict[str, Any] | None) -> bool:
    cpu = cpu or {}
    return cpu.get("vendor_id") == AMD_VENDOR_ID and (cpu.get("family") or 0) >= AMD_ZEN_FAMILY_MIN


def _whitelist_entry(pci_id: str | None) -> tuple[int, int | None, bool, str] | None:
    if not pci_id:
        return None
    vendor, device = (int(part, 16) for part in pci_id.split(":"))
    for entry in P2PDMA_HOST_BRIDGE_WHITELIST:
        if entry[0] == vendor and entry[1] in (None, device):
            return entry  # the kernel stops at the first vendor/device match
    return None


def host_bridge_whitelisted(host_a: str | None, host_b: str | None,
                            host_bridge_devices: dict[str, dict[str, Any]]) -> tuple[bool, str]:
    """host_bridge_whitelist(): (allowed, the root-bus device ids looked at)."""
    ids = [(host_bridge_devices.get(host or "") or {}).get("pci_id") for host in (host_a, host_b)]
    same = host_a == host_b
    checked = [ids[0]] if same else ids
    for pci_id in checked:
        entry = _whitelist_entry(pci_id)
        if entry is None or (entry[2] and not same):
            return False, ", ".join(str(value) for value in checked)
    return True, ", ".join(str(value) for value in checked)


def pair_topology(gpu_a: dict[str, Any], gpu_b: dict[str, Any], cpu: dict[str, Any] | None = None,
                  host_bridge_devices: dict[str, dict[str, Any]] | None = None) -> PairTopology:
    """P2PDMA's decision for one pair (calc_map_type_and_dist in drivers/pci/p2pdma.c)."""
    chain_a, chain_b = _bridge_chain(gpu_a), _bridge_chain(gpu_b)
    base = dict(a=gpu_a["index"], b=gpu_b["index"], a_address=gpu_a["pci_address"], b_address=gpu_b["pci_address"])
    host_a, host_b = gpu_a.get("host_bridge"), gpu_b.get("host_bridge")
    amd_zen = cpu_supports_p2pdma(cpu)
    whitelisted, root_ids = host_bridge_whitelisted(host_a, host_b, host_bridge_devices or {})

    def through_host_bridge() -> tuple[bool | None, str]:
        if amd_zen:
            return True, "amd-zen"
        if whitelisted:
            return True, "whitelisted-host-bridge:%s" % root_ids.split(", ")[0]
        return False, ""

    shared = 0
    if host_a == host_b:
        while (shared < min(len(chain_a), len(chain_b))
               and chain_a[shared]["address"] == chain_b[shared]["address"]):
            shared += 1
    if shared == 0:
        relation: Relation = "separate_host_bridges" if host_a != host_b else "separate_root_ports"
        where = ("different host bridges (%s, %s)" % (host_a, host_b) if host_a != host_b else
                 "separate root ports (%s, %s) of %s" % (chain_a[0]["address"] if chain_a else "?",
                                                         chain_b[0]["address"] if chain_b else "?", host_a))
        p2p, rule = through_host_bridge()
        if p2p:
            reason = "%s: the kernel's P2PDMA routes through the host bridge (%s)" % (where, rule)
        else:
            rule = "refused: no shared upstream bridge, CPU not AMD Zen, host bridge %s not whitelisted" % root_ids
            reason = "%s: the kernel's P2PDMA refuses non-whitelisted host bridges (root-bus device %s, CPU %s)" % (
                where, root_ids, (cpu or {}).get("vendor_id") or "unknown")
        return PairTopology(relation=relation, common_bridge=None, acs="not_applicable", acs_redirect_bridges=[],
                            acs_unknown_bridges=[], p2p_from_topology=p2p, p2p=p2p, reason=reason, rule=rule, **base)
    common = chain_a[shared - 1]["address"]
    # Peer requests climb from each card to the shared switch; any bridge on the way (the shared one included, as
    # the kernel walks it) with ACS redirect on sends them to the root complex instead (RR, CR, EC bits).
    path = chain_a[shared:] + [chain_a[shared - 1]] + chain_b[shared:]
    redirect = [bridge["address"] for bridge in path if bridge["acs"]["state"] == "redirect"]
    unknown = [bridge["address"] for bridge in path if bridge["acs"]["state"] == "unknown"]
    host_p2p, host_rule = through_host_bridge()
    acs: Acs
    if redirect:
        acs = "redirect"
        p2p, rule = (True, host_rule) if host_p2p else (False, "refused: ACS redirect at %s and the host bridge route "
                                                                 "is not allowed" % ", ".join(redirect))
        reason = "share the switch below %s but ACS redirect is on at %s: peer traffic is sent to the root complex" \
                 "%s" % (common, ", ".join(redirect), " (%s allows that route)" % host_rule if host_p2p else
                         " (disable ACS, e.g. keep the IOMMU off)")
    elif unknown:
        acs = "unknown"
        p2p, rule = (True, host_rule) if host_p2p else (None, "unknown: ACS not readable at %s" % ", ".join(unknown))
        reason = "share the switch below %s; ACS state not readable at %s (read config space as root, or confirm " \
                 "with Level Zero)" % (common, ", ".join(unknown))
    else:
        acs, p2p, rule = "off", True, "same-switch"
        reason = "share the switch below %s with ACS redirect off" % common
    return PairTopology(relation="same_switch", common_bridge=common, acs=acs, acs_redirect_bridges=redirect,
                        acs_unknown_bridges=unknown, p2p_from_topology=p2p, p2p=p2p, reason=reason, rule=rule, **base)


def all_pairs(gpus: Sequence[dict[str, Any]], cpu: dict[str, Any] | None = None,
              host_bridge_devices: dict[str, dict[str, Any]] | None = None) -> list[PairTopology]:
    return [pair_topology(a, b, cpu, host_bridge_devices) for a, b in itertools.combinations(gpus, 2)]


# ---------------------------------------------------------------- pure: the decision

def _group_p2p(group: Sequence[int], pairs_by_index: dict[tuple[int, int], PairTopology]) -> bool:
    return all(pairs_by_index[(a, b)].p2p is True for a, b in itertools.combinations(group, 2))


def _proven(pair: PairTopology) -> bool:
    """P2P the way oneCCL uses it: a probe opened the peer's memory. The kernel rule's yes is not proof."""
    return pair.p2p is True and pair.probe is not None and pair.probe.peer_memory_opened


NOT_PROVEN = ("no probe opened peer memory between the GPUs: the kernel's P2PDMA rule and zeDeviceCanAccessPeer do "
              "not predict oneCCL's IPC path (X570 dual-B70 hosts they allow died at zeMemOpenIpcHandle); run "
              "ze_peer -s 0 -d 1 and set --profile p2p when it passes")


def _first_group(candidates: Sequence[int], size: int, accept: Any) -> list[int] | None:
    for group in itertools.combinations(candidates, size):
        if accept(group):
            return list(group)
    return None


def _accepted(gpu: dict[str, Any], pci_ids: Sequence[str]) -> bool:
    return not pci_ids or (gpu.get("pci_id") or "").lower() in {pci_id.lower() for pci_id in pci_ids}


def decide(gpus: Sequence[dict[str, Any]], pairs: list[PairTopology], tensor_parallel_size: int | None,
           profile_override: str = "auto", pci_ids: Sequence[str] = ()) -> TopologyDecision:
    """The oneCCL profile for a tensor-parallel group of xe-bound GPUs, chosen in PCI order. pci_ids (the recipe's
    host.gpu_pci_ids, vendor:device): only GPUs of those ids join the group, as host fit counts them."""
    if profile_override not in PROFILE_CHOICES:
        raise ValueError("profile %r: choose one of %s" % (profile_override, ", ".join(PROFILE_CHOICES)))
    usable = [gpu["index"] for gpu in gpus if gpu.get("xe_bound") and _accepted(gpu, pci_ids)]
    size = tensor_parallel_size or max(len(usable), 1)
    pairs_by_index = {(pair.a, pair.b): pair for pair in pairs}
    reasons: list[str] = []
    unbound = [gpu["pci_address"] for gpu in gpus if not gpu.get("xe_bound")]
    if unbound:
        reasons.append("not bound to xe, not usable: %s" % ", ".join(unbound))
    foreign = ["%s %s (%s)" % (gpu["pci_address"], gpu.get("model"), gpu.get("pci_id")) for gpu in gpus
               if gpu.get("xe_bound") and not _accepted(gpu, pci_ids)]
    if foreign:
        reasons.append("not of the recipe's PCI ids %s, not used: %s" % (", ".join(pci_ids), ", ".join(foreign)))
    group: list[int] | None = None
    if not usable:
        auto = "no-p2p"
        reasons.append("no Intel GPU bound to xe: nothing to connect")
        why = "no usable GPU"
        group = []
    elif size < 2:
        auto = "no-p2p"
        reasons.append("tensor-parallel size %d: no peer traffic, the no-p2p set is harmless" % size)
        why = "tensor-parallel size %d: no peer traffic" % size
        group = usable[:size]
    elif len(usable) < size:
        auto = "no-p2p"
        reasons.append("tensor-parallel size %d but %d usable GPU(s)" % (size, len(usable)))
        why = reasons[-1]
        group = usable
    else:
        # Place the group where P2P is most likely (proven first, then allowed by the kernel's rule); the profile
        # is p2p only when every pair of it is proven.
        proven = _first_group(usable, size, lambda g: all(_proven(pairs_by_index[p]) for p in
                                                           itertools.combinations(g, 2)))
        allowed = _first_group(usable, size, lambda g: _group_p2p(g, pairs_by_index))
        if proven is not None:
            group = proven
            auto = "p2p"
            reasons.append("GPUs %s: every pair can do P2P (%s)" % (
                ",".join(map(str, group)),
                "; ".join(_pair_evidence(pairs_by_index[p]) for p in itertools.combinations(group, 2))))
            why = "peer memory opened between every pair of GPUs %s" % ",".join(map(str, group))
        elif allowed is not None:
            group = allowed
            auto = "no-p2p"
            reasons.append("GPUs %s: every pair may do P2P (%s), but it is not proven" % (
                ",".join(map(str, group)),
                "; ".join(_pair_evidence(pairs_by_index[p]) for p in itertools.combinations(group, 2))))
            why = NOT_PROVEN
        else:
            auto = "no-p2p"
            group = usable[:size]
            blocking = [pairs_by_index[p] for p in itertools.combinations(group, 2)
                        if pairs_by_index[p].p2p is not True]
            reasons.append("no group of %d GPUs with P2P between every pair; GPUs %s: %s" % (
                size, ",".join(map(str, group)), "; ".join(
                    "%d-%d %s" % (pair.a, pair.b, _pair_evidence(pair)) for pair in blocking)))
            why = "no group of %d GPUs with P2P between every pair" % size
    profile = auto if profile_override == "auto" else profile_override
    why = "%s: %s" % (auto, why)
    if profile != auto:
        reasons.append("profile %s set by override (auto chose %s)" % (profile, auto))
        why = "%s: set by override (auto chose %s)" % (profile, why)
    level_zero = {gpu["index"]: gpu.get("level_zero_index") for gpu in gpus}
    mask = ",".join(str(level_zero[index]) for index in group if level_zero.get(index) is not None)
    return TopologyDecision(profile=profile, auto_profile=auto,
                            profile_source="auto" if profile_override == "auto" else "override",
                            tensor_parallel_size=size, group=group, affinity_mask=mask, reasons=reasons,
                            profile_reason=why)


def _pair_evidence(pair: PairTopology) -> str:
    if pair.probe is not None and pair.probe.status in ("confirmed", "refused"):
        return "Level Zero %s: %s" % (pair.probe.status, pair.probe.detail)
    return pair.reason


def apply_probe(pair: PairTopology, probe: Probe) -> None:
    """A measurement beats the inference (docs/facts.md: a measurement on the host wins over a fact)."""
    pair.probe = probe
    if probe.status == "confirmed":
        pair.p2p = True
    elif probe.status == "refused":
        pair.p2p = False


# ---------------------------------------------------------------- the whole analysis (facts -> document)

def device_nodes(gpu: dict[str, Any]) -> list[str]:
    """The card's DRM nodes by their /dev/dri/by-path names: minor numbers follow probe order (simpledrm can take
    card0; B70 owners report them as card2/card3), the PCI address does not; llm-scaler maps GPUs by path."""
    nodes = []
    for kind in ("card", "render"):
        if gpu.get(kind):
            nodes.append("/dev/dri/by-path/pci-%s-%s" % (gpu["pci_address"], kind))
    return nodes


def analyse(facts: dict[str, Any], tensor_parallel_size: int | None = None, profile: str = "auto",
            probe: str = "auto", ze_loader: str | None = None, pci_ids: Sequence[str] = ()) -> dict[str, Any]:
    """The topology document: pairs, the chosen group and profile, the profile's env and docker flags.
    probe: 'auto' asks the Level Zero loader (ze_loader, else $B70CTL_ZE_LOADER, else libze_loader.so.1) about the
    candidate group's pairs; 'never' keeps the kernel rule's answer alone. A missing loader or a failing zeInit
    leaves the kernel rule's answer and says why in probe.detail."""
    gpus = facts["gpus"]
    pairs = all_pairs(gpus, facts.get("cpu"), facts.get("host_bridge_devices"))
    tool = level_zero.loader_path(ze_loader)
    probe_state: dict[str, Any] = {"tool": tool, "status": "skipped", "detail": None}
    if probe != "never":
        pairs_by_index = {(pair.a, pair.b): pair for pair in pairs}
        candidate = decide(gpus, pairs, tensor_parallel_size, pci_ids=pci_ids).group
        by_index = {gpu["index"]: gpu for gpu in gpus}
        wanted = [(a, b) for a, b in itertools.combinations(candidate, 2)]
        if not wanted:
            probe_state["status"] = "nothing_to_probe"
        else:
            addresses = [(by_index[a]["pci_address"], by_index[b]["pci_address"]) for a, b in wanted]
            try:
                answers = level_zero.peer_access(addresses, ze_loader)
            except level_zero.LevelZeroUnavailable as error:
                probe_state.update(status=error.status, detail=error.detail + ": the kernel's P2PDMA rule decides")
            else:
                for (a, b), key in zip(wanted, addresses):
                    answer = answers[key]
                    apply_probe(pairs_by_index[(a, b)], Probe(answer["status"], [
                        tool, "zeDeviceCanAccessPeer", "zeDeviceGetP2PProperties", "zeMemOpenIpcHandle", key[0],
                        key[1]], None, None, answer["detail"], bool(answer.get("peer_memory_opened"))))
                probe_state["status"] = "probed"
    decision = decide(gpus, pairs, tensor_parallel_size, profile, pci_ids)
    by_index = {gpu["index"]: gpu for gpu in gpus}
    chosen = CCL_PROFILES[decision.profile]
    return {
        "schema_version": TOPOLOGY_SCHEMA_VERSION,
        "profile": decision.profile,
        "profile_reason": decision.profile_reason,
        "gpu_pci_ids": [pci_id.lower() for pci_id in pci_ids],
        "auto_profile": decision.auto_profile,
        "profile_source": decision.profile_source,
        "tensor_parallel_size": decision.tensor_parallel_size,
        "group": decision.group,
        "affinity_mask": decision.affinity_mask,
        "group_devices": [node for index in decision.group for node in device_nodes(by_index[index])],
        "reasons": decision.reasons,
        "ccl_env": dict(chosen["env"]),
        "docker_args": list(chosen["docker_args"]),
        "probe": probe_state,
        "gpus": [{
            "index": gpu["index"], "level_zero_index": gpu.get("level_zero_index"), "pci_address": gpu["pci_address"],
            "model": gpu["model"], "pci_id": gpu.get("pci_id"), "host_bridge": gpu["host_bridge"],
            "root_port": gpu["parent_bridges"][0]["address"] if gpu["parent_bridges"] else None,
            "numa_node": gpu["numa_node"], "card": gpu["card"], "render": gpu["render"], "xe_bound": gpu["xe_bound"],
        } for gpu in gpus],
        "pairs": [asdict(pair) for pair in pairs],
        "p2pdma": {
            "cpu_vendor": (facts.get("cpu") or {}).get("vendor_id"),
            "cpu_family": (facts.get("cpu") or {}).get("family"),
            "amd_zen": cpu_supports_p2pdma(facts.get("cpu")),
            "host_bridge_devices": {name: entry.get("pci_id") for name, entry in
                                    sorted((facts.get("host_bridge_devices") or {}).items())},
            "whitelist_source": P2PDMA_WHITELIST_SOURCE,
        },
    }


def group_addresses(document: dict[str, Any]) -> list[str]:
    """The PCI addresses of the document's group, in group order: what a fallback record is keyed by (indices
    follow PCI order and can shift when a card is added; addresses do not)."""
    by_index = {gpu["index"]: gpu["pci_address"] for gpu in document.get("gpus", [])}
    return [by_index[index] for index in document.get("group", []) if index in by_index]


def fallback_record(document: dict[str, Any], signature: str, evidence: str, at: str) -> dict[str, Any]:
    """What the serve gate keeps when the group's p2p start died at `signature` (a catalogue id whose fix is the
    no-p2p profile), with the log line that showed it and when."""
    if document.get("profile") != "p2p":
        raise TopologyRefused("the topology's profile is %s, not p2p: there is nothing to fall back from"
                              % document.get("profile"))
    return {"schema_version": FALLBACK_SCHEMA_VERSION, "from_profile": "p2p", "to_profile": "no-p2p",
            "group": group_addresses(document), "signature": signature, "evidence": evidence.strip()[:500], "at": at}


def apply_fallback(document: dict[str, Any], record: dict[str, Any] | None,
                   path: str = FALLBACK_PATH) -> dict[str, Any]:
    """The document with no-p2p in place of p2p when `record` (a fallback record) names this group's cards; the
    document unchanged otherwise (no record, another group, or not p2p). The profile's env and docker flags follow
    (CCL_PROFILES); profile_reason says what died, when, and how to try p2p again."""
    if not record or document.get("profile") != "p2p" or record.get("group") != group_addresses(document):
        return document
    chosen = CCL_PROFILES["no-p2p"]
    reason = ("p2p died at start on these cards (%s, %s: %s); the serve gate restarted the server with no-p2p. "
              "Remove %s on the host to try p2p again" % (record.get("signature"), record.get("at"),
                                                          record.get("evidence"), path))
    return dict(document, profile="no-p2p", profile_source="fallback", profile_reason=reason,
                ccl_env=dict(chosen["env"]), docker_args=list(chosen["docker_args"]), fallback=dict(record))


def read_fallback(path: str) -> dict[str, Any] | None:
    """The fallback record at `path`; None when there is none. A record that cannot be read is refused: serving
    p2p again past it would repeat the start that died."""
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise TopologyRefused("fallback record %s cannot be read (%s): fix or remove it (removing it lets p2p be "
                              "tried again)" % (path, getattr(error, "strerror", None) or error)) from error
    if not isinstance(record, dict) or not isinstance(record.get("group"), list):
        raise TopologyRefused("fallback record %s is not a record of ccl fallback (no group list): remove it, or "
                              "let the serve gate write it" % path)
    return record


def render_document(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def write_topology(root: str, document: dict[str, Any]) -> bool:
    """Write <root>/etc/b70/topology.json atomically; False (nothing written) when the content is unchanged, so a
    second run reports changed=false. b70ctl's own writer is files.py; this file runs on hosts without b70ctl."""
    target = os.path.join(root, TOPOLOGY_PATH.lstrip("/"))
    inside = os.path.realpath(root)
    landing = os.path.realpath(os.path.dirname(target))
    if os.path.commonpath([inside, landing]) != inside:
        raise TopologyRefused("%s leads to %s, outside --root %s (a symlink): nothing was written: remove the link "
                              "or give the real root" % (os.path.dirname(target), landing, root))
    content = render_document(document)
    try:
        with open(target, encoding="utf-8") as handle:
            if handle.read() == content:
                return False
    except (OSError, UnicodeDecodeError):
        pass
    temporary = None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        handle_fd, temporary = tempfile.mkstemp(prefix=".topology.", suffix=".tmp", dir=os.path.dirname(target))
        with os.fdopen(handle_fd, "w", encoding="utf-8") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)
    except OSError as error:
        raise TopologyRefused("cannot write %s: %s; nothing was written" % (target, _write_failure(error))) from error
    finally:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
    return True


def _write_failure(error: OSError) -> str:
    """The reason in words that lead to the fix (files.write_failure's rule, for a host without b70ctl)."""
    where = error.filename or ""
    if error.errno in (errno.ENOTDIR, errno.EEXIST) and where:
        parts = [where]
        while os.path.dirname(parts[-1]) != parts[-1]:
            parts.append(os.path.dirname(parts[-1]))
        for part in reversed(parts):
            if os.path.lexists(part) and not os.path.isdir(part):
                return "%s is a file, not a directory: move it away" % part
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "%s: free space there and run again" % error.strerror
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "%s: run it as a user who may write there" % error.strerror
    return "%s (%s)" % (error.strerror, where) if where else str(error.strerror or error)


def topology(root: str = "/", tensor_parallel_size: int | None = None, profile: str = "auto",
             probe: str = "auto", write: bool = False, ze_loader: str | None = None,
             pci_ids: Sequence[str] = (), fallback_path: str | None = None) -> dict[str, Any]:
    """Read facts under root, decide, optionally write; the result carries `changed` (Ansible convention). A
    tensor-parallel group larger than the host's usable GPUs is never written: the server could not start on it.
    fallback_path: the serve gate's record (FALLBACK_PATH on a host); when it names the group, no-p2p."""
    document = analyse(collect_facts(root), tensor_parallel_size, profile, probe, ze_loader, pci_ids)
    if fallback_path:
        document = apply_fallback(document, read_fallback(fallback_path), fallback_path)
    if write and tensor_parallel_size is not None and len(document["group"]) < tensor_parallel_size:
        usable = len(document["group"])
        raise TopologyRefused(
            "tensor-parallel size %d but %d usable GPU(s) under %s (Intel discrete, bound to xe%s): nothing "
            "written: %s" % (tensor_parallel_size, usable, root, ", PCI id %s" % "/".join(pci_ids) if pci_ids else "",
                    "serve with at most %d GPU(s), or bind the others to xe" % usable if usable else
                    "bind the GPUs to xe (b70ctl host facts lists them and their driver)"))
    changed = write_topology(root, document) if write else False
    result = dict(document)
    result["changed"] = changed
    result["path"] = TOPOLOGY_PATH if write else None
    return result


def _is_pci_id(text: str) -> bool:
    parts = text.split(":")
    return len(parts) == 2 and all(len(part) == 4 and all(c in "0123456789abcdefABCDEF" for c in part)
                                   for part in parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Decide PCIe P2P and the oneCCL profile; print JSON.")
    parser.add_argument("--root", default="/")
    parser.add_argument("--profile", default="auto", choices=PROFILE_CHOICES)
    parser.add_argument("--tensor-parallel-size", type=int, default=None)
    parser.add_argument("--probe", default="auto", choices=("auto", "never"))
    parser.add_argument("--write", action="store_true", help="write <root>%s" % TOPOLOGY_PATH)
    # extend, zero or more: the role passes the recipe's list after one --pci-id, which may be empty (any GPU).
    parser.add_argument("--pci-id", action="extend", nargs="*", default=[], dest="pci_ids", metavar="VENDOR:DEVICE",
                        help="only GPUs of these PCI ids join the group (the recipe's host.gpu_pci_ids)")
    parser.add_argument("--fallback-record", default=None, metavar="PATH",
                        help="the serve gate's record of a p2p start that died (%s): no-p2p while it names the "
                             "group" % FALLBACK_PATH)
    parser.add_argument("--document", action="store_true",
                        help="print the topology document itself, as --write would write it (without changed/path)")
    args = parser.parse_args(argv)
    bad = [pci_id for pci_id in args.pci_ids if not _is_pci_id(pci_id)]
    if bad:
        sys.stderr.write("error: --pci-id %s is not vendor:device in hex (e.g. 8086:e223)\n" % bad[0])
        return 2
    if not os.path.isdir(args.root):
        sys.stderr.write("error: --root %s is not a directory: give the root of a sysfs tree\n" % args.root)
        return 2
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        sys.stderr.write("error: --tensor-parallel-size must be >= 1\n")
        return 2
    try:
        result = topology(args.root, args.tensor_parallel_size, args.profile, args.probe, args.write,
                          pci_ids=args.pci_ids, fallback_path=args.fallback_record)
    except TopologyRefused as refused:
        sys.stderr.write("error: %s\n" % refused)
        return 2
    if args.document:
        sys.stdout.write(render_document({key: value for key, value in result.items()
                                          if key not in ("changed", "path")}))
    else:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
