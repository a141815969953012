#!/usr/bin/env python3
"""PCIe peer-to-peer between the host's GPUs, and the oneCCL profile that follows from it.

Per GPU pair, from the PCIe tree in the facts (facts.py):
- same_switch: both cards sit below one PCIe switch under one root port. P2P is possible when no bridge on the
  way from either card up to that switch redirects peer requests (ACS RR/CR/EC off); with ACS redirect on, the
  traffic goes to the root complex instead; when ACS is not readable (not root) the answer is unknown.
- separate_root_ports / separate_host_bridges: no P2P. The kernel's P2PDMA only routes between root ports of
  whitelisted host bridges, and B70s on separate CPU root ports were refused (FACTS.md).
A `ze_peer -s A -d B` probe (level-zero-tests), where installed, confirms or refutes a pair: a measurement beats
the inference. Not installed means not probed, never failed.

Profile: `p2p` (the recipe's oneCCL set with CCL_TOPO_P2P_ACCESS=1) only when every pair of the tensor-parallel
group is known to do P2P; otherwise `no-p2p` (the SIMPLE_THRESHOLD fallback confirmed on dual B70). The host
may override it (`--profile`, Ansible var). CCL_PROFILES below is the one place the profiles' env vars and
docker flags are written; the serve renderer reads it (or the copy written into /etc/b70/topology.json).

Standard library only, like facts.py, so both files can run on a host with just python3.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

if __package__:
    from b70ctl.host.facts import collect_facts
else:  # run as a script next to facts.py on a host
    from facts import collect_facts  # type: ignore[no-redef]

TOPOLOGY_SCHEMA_VERSION = 1
TOPOLOGY_PATH = "/etc/b70/topology.json"
PROFILES = ("p2p", "no-p2p")
PROFILE_CHOICES = ("auto",) + PROFILES
ZE_PEER = "ze_peer"
ZE_PEER_TIMEOUT_S = 300

# The oneCCL profiles: the single source of these env vars and docker flags (FACTS.md, "P2P and the no-P2P
# path"). `p2p` is the PR #620 recipe's set; `no-p2p` is the fallback confirmed on dual B70 without P2P
# (CCL_TOPO_P2P_ACCESS=0 alone still failed with zeMemOpenIpcHandle errors in several reports).
CCL_PROFILES: Dict[str, Dict[str, Any]] = {
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


@dataclass
class Probe:
    """One ze_peer run between two Level Zero devices."""

    status: str  # confirmed | refused | inconclusive | not_probed
    command: List[str] = field(default_factory=list)
    exit_code: Optional[int] = None
    peak_gb_per_s: Optional[float] = None
    detail: str = ""


@dataclass
class PairTopology:
    a: int
    b: int
    a_address: str
    b_address: str
    relation: str  # same_switch | separate_root_ports | separate_host_bridges
    common_bridge: Optional[str]
    acs: str  # off | redirect | unknown | not_applicable
    acs_redirect_bridges: List[str]
    acs_unknown_bridges: List[str]
    p2p_from_topology: Optional[bool]
    p2p: Optional[bool]
    reason: str
    probe: Optional[Probe] = None


@dataclass
class TopologyDecision:
    profile: str
    auto_profile: str
    profile_source: str  # auto | override
    tensor_parallel_size: int
    group: List[int]
    affinity_mask: str
    reasons: List[str]


# ---------------------------------------------------------------- pure: pairs

def _bridge_chain(gpu: Dict[str, Any]) -> List[Dict[str, Any]]:
    return list(gpu.get("parent_bridges") or [])


def pair_topology(gpu_a: Dict[str, Any], gpu_b: Dict[str, Any]) -> PairTopology:
    chain_a, chain_b = _bridge_chain(gpu_a), _bridge_chain(gpu_b)
    base = dict(a=gpu_a["index"], b=gpu_b["index"], a_address=gpu_a["pci_address"], b_address=gpu_b["pci_address"])
    if gpu_a.get("host_bridge") != gpu_b.get("host_bridge"):
        return PairTopology(relation="separate_host_bridges", common_bridge=None, acs="not_applicable",
                            acs_redirect_bridges=[], acs_unknown_bridges=[], p2p_from_topology=False, p2p=False,
                            reason="different host bridges (%s, %s): the kernel's P2PDMA refuses the route" % (
                                gpu_a.get("host_bridge"), gpu_b.get("host_bridge")), **base)
    shared = 0
    while (shared < min(len(chain_a), len(chain_b))
           and chain_a[shared]["address"] == chain_b[shared]["address"]):
        shared += 1
    if shared == 0:
        return PairTopology(relation="separate_root_ports", common_bridge=None, acs="not_applicable",
                            acs_redirect_bridges=[], acs_unknown_bridges=[], p2p_from_topology=False, p2p=False,
                            reason="separate root ports (%s, %s) of %s: the kernel's P2PDMA refuses "
                                   "non-whitelisted host bridges" % (
                                       chain_a[0]["address"] if chain_a else "?",
                                       chain_b[0]["address"] if chain_b else "?", gpu_a.get("host_bridge")),
                            **base)
    common = chain_a[shared - 1]["address"]
    # Peer requests climb from each card to the shared switch; any bridge on the way with ACS redirect on
    # sends them to the root complex instead (the kernel checks the same bits: RR, CR, EC).
    below = chain_a[shared:] + chain_b[shared:]
    redirect = [bridge["address"] for bridge in below if bridge["acs"]["state"] == "redirect"]
    unknown = [bridge["address"] for bridge in below if bridge["acs"]["state"] == "unknown"]
    if redirect:
        acs, p2p, reason = "redirect", False, "share the switch below %s but ACS redirect is on at %s: peer " \
            "traffic is sent to the root complex (disable ACS, e.g. keep the IOMMU off)" % (common, ", ".join(redirect))
    elif unknown:
        acs, p2p, reason = "unknown", None, "share the switch below %s; ACS state not readable at %s (read config " \
            "space as root, or confirm with ze_peer)" % (common, ", ".join(unknown))
    else:
        acs, p2p, reason = "off", True, "share the switch below %s with ACS redirect off" % common
    return PairTopology(relation="same_switch", common_bridge=common, acs=acs, acs_redirect_bridges=redirect,
                        acs_unknown_bridges=unknown, p2p_from_topology=p2p, p2p=p2p, reason=reason, **base)


def all_pairs(gpus: Sequence[Dict[str, Any]]) -> List[PairTopology]:
    return [pair_topology(a, b) for a, b in itertools.combinations(gpus, 2)]


# ---------------------------------------------------------------- pure: ze_peer output

_ERROR_MARKERS = ("ERROR", "ZE_RESULT_ERROR", "terminate called", "no peer devices", "Segmentation fault")
_GBPS_TABLE_ROW = re.compile(r"^\s*\d+\s*[KMG]?B?\s*[|:]\s*([0-9]+(?:\.[0-9]+)?)\s*$")
_FLOAT = re.compile(r"[0-9]+\.[0-9]+|[0-9]+")


def parse_ze_peer_output(output: str, exit_code: Optional[int]) -> Tuple[str, Optional[float], str]:
    """(status, peak GB/s, detail) from ze_peer's stdout+stderr. Bandwidth appears as ' Device(0)->Device(1):
    GBPS 21.5' (old), 'BW [GBPS]:  256 MB:    21.34' (1.x), or rows under a ' Size   | BW [GBPS] ' header."""
    error_lines = [line.strip() for line in output.splitlines() if any(m in line for m in _ERROR_MARKERS)]
    figures: List[float] = []
    in_table = False
    for line in output.splitlines():
        if "BW [GBPS]" in line and not _FLOAT.search(line.split("BW [GBPS]")[1]):
            in_table = True  # the header of a size | bandwidth table
            continue
        if "GBPS" in line:
            numbers = _FLOAT.findall(line.split("GBPS", 1)[1])
            if numbers:
                figures.append(float(numbers[-1]))
            continue
        if in_table:
            row = _GBPS_TABLE_ROW.match(line)
            if row:
                figures.append(float(row.group(1)))
            elif line.strip():
                in_table = False
    peak = max(figures) if figures else None
    if exit_code not in (0, None) or error_lines:
        detail = error_lines[0] if error_lines else "ze_peer exited with %s" % exit_code
        return "refused", peak, detail
    if peak is not None and peak > 0:
        return "confirmed", peak, "peer copies ran at up to %.2f GB/s" % peak
    return "inconclusive", peak, "ze_peer printed no bandwidth figure"


def run_ze_peer(tool: str, source: int, destination: int, timeout_s: float = ZE_PEER_TIMEOUT_S) -> Probe:
    command = [tool, "-s", str(source), "-d", str(destination)]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return Probe("inconclusive", command, None, None, "ze_peer did not finish in %d s" % timeout_s)
    except OSError as error:
        return Probe("inconclusive", command, None, None, "ze_peer could not run: %s" % error)
    status, peak, detail = parse_ze_peer_output(completed.stdout + "\n" + completed.stderr, completed.returncode)
    return Probe(status, command, completed.returncode, peak, detail)


# ---------------------------------------------------------------- pure: the decision

def _group_p2p(group: Sequence[int], pairs_by_index: Dict[Tuple[int, int], PairTopology]) -> bool:
    return all(pairs_by_index[(a, b)].p2p is True for a, b in itertools.combinations(group, 2))


def _first_group(candidates: Sequence[int], size: int, accept: Any) -> Optional[List[int]]:
    for group in itertools.combinations(candidates, size):
        if accept(group):
            return list(group)
    return None


def decide(gpus: Sequence[Dict[str, Any]], pairs: List[PairTopology], tensor_parallel_size: Optional[int],
           profile_override: str = "auto") -> TopologyDecision:
    """The oneCCL profile for a tensor-parallel group of xe-bound GPUs, chosen in PCI order."""
    if profile_override not in PROFILE_CHOICES:
        raise ValueError("profile %r: choose one of %s" % (profile_override, ", ".join(PROFILE_CHOICES)))
    usable = [gpu["index"] for gpu in gpus if gpu.get("xe_bound")]
    size = tensor_parallel_size or max(len(usable), 1)
    pairs_by_index = {(pair.a, pair.b): pair for pair in pairs}
    reasons: List[str] = []
    unbound = [gpu["pci_address"] for gpu in gpus if not gpu.get("xe_bound")]
    if unbound:
        reasons.append("not bound to xe, not usable: %s" % ", ".join(unbound))
    group: Optional[List[int]] = None
    if not usable:
        auto = "no-p2p"
        reasons.append("no Intel GPU bound to xe: nothing to connect")
        group = []
    elif size < 2:
        auto = "no-p2p"
        reasons.append("tensor-parallel size %d: no peer traffic, the no-p2p set is harmless" % size)
        group = usable[:size]
    elif len(usable) < size:
        auto = "no-p2p"
        reasons.append("tensor-parallel size %d but %d usable GPU(s)" % (size, len(usable)))
        group = usable
    else:
        group = _first_group(usable, size, lambda g: _group_p2p(g, pairs_by_index))
        if group is not None:
            auto = "p2p"
            reasons.append("GPUs %s: every pair can do P2P (%s)" % (
                ",".join(map(str, group)),
                "; ".join(_pair_evidence(pairs_by_index[p]) for p in itertools.combinations(group, 2))))
        else:
            auto = "no-p2p"
            group = usable[:size]
            blocking = [pairs_by_index[p] for p in itertools.combinations(group, 2) if pairs_by_index[p].p2p is not True]
            reasons.append("no group of %d GPUs with P2P between every pair; GPUs %s: %s" % (
                size, ",".join(map(str, group)), "; ".join(
                    "%d-%d %s" % (pair.a, pair.b, _pair_evidence(pair)) for pair in blocking)))
    profile = auto if profile_override == "auto" else profile_override
    if profile != auto:
        reasons.append("profile %s set by override (auto chose %s)" % (profile, auto))
    level_zero = {gpu["index"]: gpu.get("level_zero_index") for gpu in gpus}
    mask = ",".join(str(level_zero[index]) for index in group if level_zero.get(index) is not None)
    return TopologyDecision(profile=profile, auto_profile=auto,
                            profile_source="auto" if profile_override == "auto" else "override",
                            tensor_parallel_size=size, group=group, affinity_mask=mask, reasons=reasons)


def _pair_evidence(pair: PairTopology) -> str:
    if pair.probe is not None and pair.probe.status in ("confirmed", "refused"):
        return "ze_peer %s: %s" % (pair.probe.status, pair.probe.detail)
    return pair.reason


def apply_probe(pair: PairTopology, probe: Probe) -> None:
    """A measurement beats the inference (FACTS.md: trust what you measure)."""
    pair.probe = probe
    if probe.status == "confirmed":
        pair.p2p = True
    elif probe.status == "refused":
        pair.p2p = False


# ---------------------------------------------------------------- the whole analysis (facts -> document)

def analyse(facts: Dict[str, Any], tensor_parallel_size: Optional[int] = None, profile: str = "auto",
            probe: str = "auto", ze_peer: Optional[str] = None) -> Dict[str, Any]:
    """The topology document: pairs, the chosen group and profile, the profile's env and docker flags.
    probe: 'auto' runs ze_peer on the candidate group's pairs when it is on PATH; 'never' skips it."""
    gpus = facts["gpus"]
    pairs = all_pairs(gpus)
    tool = ze_peer or shutil.which(ZE_PEER)
    probe_state = {"tool": tool, "status": "not_installed" if tool is None else "available"}
    if probe == "never":
        probe_state["status"] = "skipped"
    elif tool is not None:
        pairs_by_index = {(pair.a, pair.b): pair for pair in pairs}
        candidate = decide(gpus, pairs, tensor_parallel_size).group
        # Probe the group the topology would pick (or the first group): Level Zero indices, not PCI order.
        level_zero = {gpu["index"]: gpu.get("level_zero_index") for gpu in gpus}
        probed = 0
        for a, b in itertools.combinations(candidate, 2):
            if level_zero.get(a) is None or level_zero.get(b) is None:
                continue
            apply_probe(pairs_by_index[(a, b)], run_ze_peer(tool, level_zero[a], level_zero[b]))
            probed += 1
        probe_state["status"] = "probed" if probed else "nothing_to_probe"
    decision = decide(gpus, pairs, tensor_parallel_size, profile)
    by_index = {gpu["index"]: gpu for gpu in gpus}
    chosen = CCL_PROFILES[decision.profile]
    return {
        "schema_version": TOPOLOGY_SCHEMA_VERSION,
        "profile": decision.profile,
        "auto_profile": decision.auto_profile,
        "profile_source": decision.profile_source,
        "tensor_parallel_size": decision.tensor_parallel_size,
        "group": decision.group,
        "affinity_mask": decision.affinity_mask,
        "group_devices": [dev for index in decision.group for dev in by_index[index]["dev_nodes"]],
        "reasons": decision.reasons,
        "ccl_env": dict(chosen["env"]),
        "docker_args": list(chosen["docker_args"]),
        "probe": probe_state,
        "gpus": [{
            "index": gpu["index"], "level_zero_index": gpu.get("level_zero_index"), "pci_address": gpu["pci_address"],
            "model": gpu["model"], "host_bridge": gpu["host_bridge"],
            "root_port": gpu["parent_bridges"][0]["address"] if gpu["parent_bridges"] else None,
            "numa_node": gpu["numa_node"], "card": gpu["card"], "render": gpu["render"], "xe_bound": gpu["xe_bound"],
        } for gpu in gpus],
        "pairs": [asdict(pair) for pair in pairs],
    }


def render_document(document: Dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def write_topology(root: str, document: Dict[str, Any]) -> bool:
    """Write <root>/etc/b70/topology.json atomically; False (nothing written) when the content is unchanged, so a
    second run reports changed=false."""
    target = os.path.join(root, TOPOLOGY_PATH.lstrip("/"))
    content = render_document(document)
    try:
        with open(target, encoding="utf-8") as handle:
            if handle.read() == content:
                return False
    except OSError:
        pass
    os.makedirs(os.path.dirname(target), exist_ok=True)
    handle_fd, temporary = tempfile.mkstemp(prefix=".topology.", dir=os.path.dirname(target))
    try:
        with os.fdopen(handle_fd, "w", encoding="utf-8") as handle:
            handle.write(content)
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return True


def topology(root: str = "/", tensor_parallel_size: Optional[int] = None, profile: str = "auto",
             probe: str = "auto", write: bool = False, ze_peer: Optional[str] = None) -> Dict[str, Any]:
    """Read facts under root, decide, optionally write; the result carries `changed` (Ansible convention)."""
    document = analyse(collect_facts(root), tensor_parallel_size, profile, probe, ze_peer)
    changed = write_topology(root, document) if write else False
    result = dict(document)
    result["changed"] = changed
    result["path"] = TOPOLOGY_PATH if write else None
    return result


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Decide PCIe P2P and the oneCCL profile; print JSON.")
    parser.add_argument("--root", default="/")
    parser.add_argument("--profile", default="auto", choices=PROFILE_CHOICES)
    parser.add_argument("--tensor-parallel-size", type=int, default=None)
    parser.add_argument("--probe", default="auto", choices=("auto", "never"))
    parser.add_argument("--write", action="store_true", help="write <root>%s" % TOPOLOGY_PATH)
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        sys.stderr.write("error: --root %s is not a directory: give the root of a sysfs tree\n" % args.root)
        return 2
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        sys.stderr.write("error: --tensor-parallel-size must be >= 1\n")
        return 2
    result = topology(args.root, args.tensor_parallel_size, args.profile, args.probe, args.write)
    sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
