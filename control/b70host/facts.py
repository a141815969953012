#!/usr/bin/env python3
"""GPU inventory of one host, read from sysfs/procfs under a root prefix, printed as JSON.

STANDARD LIBRARY ONLY: this very file is installed on hosts as the Ansible local fact
/etc/ansible/facts.d/b70.fact and run there by the host's own python3 (3.8+), so plays can gate on
`ansible_local.b70`. `b70ctl host facts` imports the same `collect_facts`, so the CLI and the fact print the
same JSON. Every path is read below `root` so tests feed real-shaped fixture trees through this code.

What is counted as a GPU: an Intel (0x8086) PCI function of display class 0x03 that is discrete. The on-board
PCIe switch of a Battlemage card (upstream port 8086:e2ff, downstream ports 8086:e2f0/e2f1) and its audio
function (8086:e2f7) are never GPUs: they are not display class. Intel's own script counts GPUs with
`grep -E "e211|e210"` and so misses every B70 (8086:e223); the model table below is by full PCI id.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import stat
import struct
import sys
from typing import Any

SCHEMA_VERSION = 1
INTEL_VENDOR_ID = 0x8086
XE_DRIVER = "xe"

# PCI device id -> (short model, marketing name, die, nominal VRAM GiB). BMG-G31 ids e220-e223, BMG-G21 ids
# e202, e209, e20b-e20d, e210-e212, e215, e216 (docs/facts.md, Hardware). Unnamed ids keep their die name.
BATTLEMAGE_MODELS: dict[int, tuple[str, str, str, float | None]] = {
    0xE223: ("B70", "Intel Arc Pro B70", "BMG-G31", 32.0),
    0xE220: ("BMG-G31", "Intel Battlemage G31", "BMG-G31", None),
    0xE221: ("BMG-G31", "Intel Battlemage G31", "BMG-G31", None),
    0xE222: ("BMG-G31", "Intel Battlemage G31", "BMG-G31", None),
    0xE211: ("B60", "Intel Arc Pro B60", "BMG-G21", 24.0),
    0xE212: ("B50", "Intel Arc Pro B50", "BMG-G21", 16.0),
    0xE20B: ("B580", "Intel Arc B580", "BMG-G21", 12.0),
    0xE20C: ("B570", "Intel Arc B570", "BMG-G21", 10.0),
}
for _device_id in (0xE202, 0xE209, 0xE20D, 0xE210, 0xE215, 0xE216):
    BATTLEMAGE_MODELS[_device_id] = ("BMG-G21", "Intel Battlemage G21", "BMG-G21", None)

# The on-board PCIe switch every Battlemage card carries in front of its GPU: not a GPU, never counted.
BATTLEMAGE_BOARD_BRIDGE_IDS = frozenset({0xE2FF, 0xE2F0, 0xE2F1})

# PCIe capability "device/port type" (PCIe base spec, Express Capabilities register bits 7:4).
PORT_TYPES = {
    0x0: "endpoint",
    0x1: "legacy_endpoint",
    0x4: "root_port",
    0x5: "switch_upstream",
    0x6: "switch_downstream",
    0x7: "pcie_to_pci_bridge",
    0x8: "pci_to_pcie_bridge",
    0x9: "root_complex_integrated_endpoint",
    0xA: "root_complex_event_collector",
}

# ACS Control register bits (PCIe base spec 7.7.8). The kernel's P2PDMA treats a bridge as redirecting
# peer traffic to the root complex when any of RR, CR or EC is set (pci_bridge_has_acs_redir).
ACS_SOURCE_VALIDATION = 0x01
ACS_TRANSLATION_BLOCKING = 0x02
ACS_REQUEST_REDIRECT = 0x04
ACS_COMPLETION_REDIRECT = 0x08
ACS_UPSTREAM_FORWARDING = 0x10
ACS_EGRESS_CONTROL = 0x20
ACS_DIRECT_TRANSLATED = 0x40
ACS_REDIRECT_BITS = ACS_REQUEST_REDIRECT | ACS_COMPLETION_REDIRECT | ACS_EGRESS_CONTROL

PCI_EXT_CAP_ACS = 0x000D
PCI_CAP_EXPRESS = 0x10
PCI_CONFIG_EXTENDED_START = 0x100

FIRMWARE_FILES = ("xe/bmg_guc_70.bin", "xe/bmg_huc.bin")
# Where the kernel's firmware loader looks, in its order (drivers/base/firmware_loader/main.c: fw_path[], each
# directory tried for the plain name, then, with CONFIG_FW_LOADER_COMPRESS_ZSTD / _XZ, every directory again for
# NAME.zst, then NAME.xz). {release} is the running kernel's (UTS_RELEASE). The first file found is the one loaded.
FIRMWARE_DIRS = ("/lib/firmware/updates/{release}", "/lib/firmware/updates", "/lib/firmware/{release}",
                 "/lib/firmware")
FIRMWARE_SUFFIXES = ("", ".zst", ".xz")
# A uC binary is well under a MiB (GuC 70.72.1: 385,856 bytes); a decompressed one larger than this is not one.
MAX_FIRMWARE_BYTES = 8 * 2**20
GUC_RECOMMENDED = (70, 54, 0)

PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
HOST_BRIDGE_DIR = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
SMALL_BAR_BYTES = 256 * 1024 * 1024


# ---------------------------------------------------------------- small readers (I/O at the rim)

def _path(root: str, absolute: str) -> str:
    return os.path.join(root, absolute.lstrip("/"))


# Most bytes of one sysfs, procfs or firmware file read. A sysfs attribute is a page at most, /proc/cpuinfo some
# KiB per CPU, a GuC or HuC blob a few MiB; a root prefix holding something else there (a FIFO, /dev/zero, a
# large file) must not hang the fact or fill the host's memory: what is not a regular file, or is larger, is
# read as missing.
MAX_READ_BYTES = 16 * 2**20


def _read_bytes(path: str) -> bytes | None:
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        found = os.fstat(handle)
        # procfs gives 0 as a file's size and sysfs a page: a size above the cap is never a kernel file.
        if not stat.S_ISREG(found.st_mode) or found.st_size > MAX_READ_BYTES:
            return None
        chunks = []
        total = 0
        while total <= MAX_READ_BYTES:
            chunk = os.read(handle, min(2**20, MAX_READ_BYTES + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks) if total <= MAX_READ_BYTES else None
    except OSError:
        return None
    finally:
        os.close(handle)


def _read_text(path: str) -> str | None:
    raw = _read_bytes(path)
    if raw is None:
        return None
    # As text mode reads it: undecodable bytes replaced, \r\n and \r read as \n.
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n").strip()


def _read_hex(path: str) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text, 16)
    except ValueError:
        return None


def _read_int(path: str) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text, 10)
    except ValueError:
        return None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _link_problem(link: str) -> str | None:
    """Why an entry of /sys/bus/pci/devices cannot be followed (a dangling link, a loop), or None when it can."""
    try:
        os.stat(link)
        return None
    except OSError as error:
        if error.errno == errno.ENOENT and os.path.islink(link):
            return "%s: dangling link (to %s): that device was not read" % (link, os.readlink(link))
        return "%s: %s: that device was not read" % (link, error.strerror)


def _id_file_problem(path: str) -> str:
    """Why a PCI id file (vendor, device, class) gave no number: missing, unreadable, not text or not hex."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as error:
        return "%s: %s" % (path, error.strerror)
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return "%s is not a regular file" % path
        raw = os.read(handle, 64)
    except OSError as error:
        return "%s: %s" % (path, error.strerror)
    finally:
        os.close(handle)
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return "%s is not text" % path
    return "%s holds %r, not a hex id" % (path, text[:20])


def _link_name(path: str) -> str | None:
    """Last component of a symlink's target (e.g. the driver name of `.../driver`), or None."""
    try:
        return os.path.basename(os.readlink(path).rstrip("/"))
    except OSError:
        return None


# ---------------------------------------------------------------- parsers (pure)

def parse_link_speed_gts(text: str | None) -> float | None:
    """'16.0 GT/s PCIe' (kernels >= 4.17) or '16 GT/s' -> 16.0; 'Unknown' -> None."""
    if not text:
        return None
    match = re.match(r"^\s*([0-9.]+)\s*GT/s", text)
    return float(match.group(1)) if match else None


def parse_resource_sizes(text: str | None) -> dict[int, int]:
    """The `resource` file: one 'start end flags' line (hex) per BAR/ROM; returns {bar index: size in bytes}."""
    sizes: dict[int, int] = {}
    if not text:
        return sizes
    for index, line in enumerate(text.splitlines()):
        fields = line.split()
        if len(fields) < 2:
            continue
        try:
            start, end = int(fields[0], 16), int(fields[1], 16)
        except ValueError:
            continue
        if end > start:
            sizes[index] = end - start + 1
    return sizes


def parse_resize_sizes_bytes(text: str | None) -> list[int]:
    """`resourceN_resize`: bitmask of supported BAR sizes, bit n = 2^n MiB (pci_rebar_get_possible_sizes)."""
    if not text:
        return []
    try:
        mask = int(text, 16)
    except ValueError:
        return []
    return [(1 << bit) * 1024 * 1024 for bit in range(64) if mask & (1 << bit)]


def parse_meminfo_total_bytes(text: str | None) -> int | None:
    if not text:
        return None
    match = re.search(r"^MemTotal:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def parse_cpuinfo(text: str | None) -> dict[str, Any]:
    """vendor_id and cpu family of the first processor in /proc/cpuinfo ('cpu family' is the kernel's x86 family,
    extended family included: 25 = 0x19 on Zen 3/4)."""
    result: dict[str, Any] = {"vendor_id": None, "family": None}
    for line in (text or "").splitlines():
        if not line.strip():
            if result["vendor_id"] is not None:
                break  # end of the first processor's block
            continue
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "vendor_id" and result["vendor_id"] is None:
            result["vendor_id"] = value
        elif key == "cpu family" and result["family"] is None and value.isdigit():
            result["family"] = int(value)
    return result


def pcie_port_type(config: bytes | None) -> str | None:
    """Device/port type from the PCI Express capability in config space, or None when not visible."""
    if not config or len(config) < 64:
        return None
    status = struct.unpack_from("<H", config, 0x06)[0]
    if not status & 0x10:  # no capability list
        return None
    pointer = config[0x34] & 0xFC
    seen = set()
    while pointer >= 0x40 and pointer + 4 <= len(config) and pointer not in seen:
        seen.add(pointer)
        cap_id, next_pointer = config[pointer], config[pointer + 1] & 0xFC
        if cap_id == PCI_CAP_EXPRESS:
            flags = struct.unpack_from("<H", config, pointer + 2)[0]
            kind = (flags >> 4) & 0xF
            return PORT_TYPES.get(kind, "type_%x" % kind)
        pointer = next_pointer
    return None


def acs_state(config: bytes | None) -> dict[str, Any]:
    """ACS capability and control of a bridge from its config space.

    Extended config space (offset >= 0x100) is only readable by root: as non-root sysfs returns 64 bytes, and
    then the state is 'unknown'. 'absent' (no ACS capability) redirects nothing.
    """
    if not config or len(config) < PCI_CONFIG_EXTENDED_START + 4:
        return {"state": "unknown", "reason": "extended config space not readable (run as root)"}
    offset = PCI_CONFIG_EXTENDED_START
    seen = set()
    while offset >= PCI_CONFIG_EXTENDED_START and offset + 8 <= len(config) and offset not in seen:
        seen.add(offset)
        header = struct.unpack_from("<I", config, offset)[0]
        if header in (0, 0xFFFFFFFF):
            break
        if header & 0xFFFF == PCI_EXT_CAP_ACS:
            capability, control = struct.unpack_from("<HH", config, offset + 4)
            redirect = bool(control & ACS_REDIRECT_BITS)
            return {
                "state": "redirect" if redirect else "off",
                "capability": "0x%04x" % capability,
                "control": "0x%04x" % control,
                "request_redirect": bool(control & ACS_REQUEST_REDIRECT),
                "completion_redirect": bool(control & ACS_COMPLETION_REDIRECT),
                "egress_control": bool(control & ACS_EGRESS_CONTROL),
                "source_validation": bool(control & ACS_SOURCE_VALIDATION),
                "upstream_forwarding": bool(control & ACS_UPSTREAM_FORWARDING),
            }
        offset = (header >> 20) & 0xFFC
    return {"state": "absent"}


def parse_uc_info(text: str | None) -> dict[str, Any] | None:
    """xe debugfs gtN/uc/{guc,huc}_info, as printed by xe_uc_fw_print:
    'GuC firmware: xe/bmg_guc_70.bin' / '\\tstatus: RUNNING' / '\\twanted release version 70.44.1' /
    '\\tfound release version 70.49.4' / '\\tfound compatibility version 1.24.0'."""
    if not text:
        return None
    result: dict[str, Any] = {"source": "debugfs"}
    header = re.search(r"^(\w+) firmware: (\S*)", text, re.MULTILINE)
    if header:
        result["path"] = header.group(2)
    status = re.search(r"^\s*status: (.+)$", text, re.MULTILINE)
    if status:
        result["status"] = status.group(1).strip()
    for kind, label in (("wanted", "wanted"), ("found", "found")):
        for match in re.finditer(r"^\s*%s (\w+) version ([0-9.]+)" % label, text, re.MULTILINE):
            result["%s_%s" % (kind, match.group(1))] = match.group(2)
    return result if "path" in result or "status" in result else None


def parse_css_release_version(blob: bytes | None) -> str | None:
    """Release version from a CSS-headed uC binary (GuC): sw_version at offset 64, major/minor/patch in bits
    23:16, 15:8, 7:0. Header integrity checked as the driver does; None for other layouts (GSC/CPD HuC) or
    compressed files."""
    if not blob or len(blob) < 128:
        return None
    header_size_dw, = struct.unpack_from("<I", blob, 4)
    key_size_dw, modulus_size_dw, exponent_size_dw = struct.unpack_from("<III", blob, 28)
    if (header_size_dw - key_size_dw - modulus_size_dw - exponent_size_dw) * 4 != 128:
        return None
    sw_version, = struct.unpack_from("<I", blob, 64)
    return "%d.%d.%d" % ((sw_version >> 16) & 0xFF, (sw_version >> 8) & 0xFF, sw_version & 0xFF)


# The GSC layout HuC binaries use since DG2/MTL (BMG's xe/bmg_huc.bin): a Code Partition Directory (CPD) whose
# entries point at named sections. Sizes and offsets of the packed little-endian structs gsc_cpd_header_v2,
# gsc_cpd_entry and gsc_manifest_header in Linux's drivers/gpu/drm/xe/xe_uc_fw_abi.h.
GSC_CPD_HEADER_MARKER = 0x44504324  # "$CPD"
# Header: u32 marker, u32 num_of_entries, u8 header_version, entry_version, header_length, flags, u32
# partition_name, u32 crc32.
GSC_CPD_HEADER_SIZE = 20
GSC_CPD_HEADER_LENGTH_OFFSET = 10
GSC_CPD_ENTRY_SIZE = 24  # u8 name[12], u32 offset (bits 24:0; bit 25 huffman), u32 length, u8 reserved[4]
GSC_CPD_ENTRY_NAME_BYTES = 12
GSC_CPD_ENTRY_OFFSET_MASK = (1 << 25) - 1
GSC_MANIFEST_HEADER_SIZE = 128
GSC_MANIFEST_FW_VERSION_OFFSET = 36  # after nine u32; struct gsc_version is u16 major, minor, hotfix, build
HUC_MANIFEST_ENTRY = "HUCP.man"
HUC_FIRMWARE_ENTRY = "huc_fw"


def is_cpd_blob(blob: bytes | None) -> bool:
    """The driver's is_cpd_header (after parse_cpd_header's size check): a CPD header marker at offset 0."""
    return blob is not None and len(blob) >= GSC_CPD_HEADER_SIZE and \
        struct.unpack_from("<I", blob, 0)[0] == GSC_CPD_HEADER_MARKER


def parse_cpd_release_version(blob: bytes | None, manifest_entry: str = HUC_MANIFEST_ENTRY) -> str | None:
    """Release version of a GSC/CPD-packaged uC binary (HuC since DG2/MTL): the fw_version major.minor.hotfix of
    the manifest the CPD entry `manifest_entry` points at, read with the checks of parse_cpd_header in Linux's
    drivers/gpu/drm/xe/xe_uc_fw.c (structs in xe_uc_fw_abi.h): the marker, header_length at least the header's
    size, every entry inside the file, the entry found by name (strcmp on its 12 bytes) at a non-zero offset
    (bits 24:0), the whole manifest header inside the file. Anything else (truncated, garbage, not CPD) is None,
    never an exception.

    The driver then parses the CSS header of the "huc_fw" entry, and that header's sw_version overwrites the
    manifest's: it is the release debugfs huc_info prints. So does this: the CSS release of "huc_fw" when that
    entry holds a valid CSS header, else the manifest's fw_version."""
    if blob is None or not is_cpd_blob(blob):
        return None
    entries, = struct.unpack_from("<I", blob, 4)
    header_length = blob[GSC_CPD_HEADER_LENGTH_OFFSET]
    if header_length < GSC_CPD_HEADER_SIZE or len(blob) < header_length + GSC_CPD_ENTRY_SIZE * entries:
        return None
    offsets: dict[bytes, int] = {}
    for index in range(entries):
        start = header_length + index * GSC_CPD_ENTRY_SIZE
        name = blob[start:start + GSC_CPD_ENTRY_NAME_BYTES].split(b"\0", 1)[0]
        offsets.setdefault(name, struct.unpack_from("<I", blob, start + GSC_CPD_ENTRY_NAME_BYTES)[0]
                           & GSC_CPD_ENTRY_OFFSET_MASK)
    offset = offsets.get(manifest_entry.encode("ascii"), 0)
    if not offset or len(blob) < offset + GSC_MANIFEST_HEADER_SIZE:
        return None
    firmware = offsets.get(HUC_FIRMWARE_ENTRY.encode("ascii"), 0)
    css_release = parse_css_release_version(blob[firmware:]) if firmware else None
    if css_release is not None:
        return css_release
    major, minor, hotfix = struct.unpack_from("<HHH", blob, offset + GSC_MANIFEST_FW_VERSION_OFFSET)
    return "%d.%d.%d" % (major, minor, hotfix)


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    if not text or not re.match(r"^\d+(\.\d+)*$", text):
        return None
    return tuple(int(part) for part in text.split("."))


# ---------------------------------------------------------------- PCI tree

def _pci_device(root: str, address: str) -> dict[str, Any]:
    """Identity of one PCI function and where it sits in the tree (its resolved /sys/devices path)."""
    link = _path(root, "/sys/bus/pci/devices/" + address)
    real = os.path.realpath(link)
    # Components of /sys/devices/pciDDDD:BB/<bridge>/<bridge>/.../<address>: the chain from the host bridge.
    devices_dir = os.path.realpath(_path(root, "/sys/devices"))
    relative = os.path.relpath(real, devices_dir).split(os.sep)
    host_bridge = relative[0] if relative and HOST_BRIDGE_DIR.match(relative[0]) else None
    ancestors = [part for part in relative[1:-1] if PCI_ADDRESS.match(part)]
    vendor = _read_hex(os.path.join(real, "vendor"))
    device = _read_hex(os.path.join(real, "device"))
    pci_class = _read_hex(os.path.join(real, "class"))
    return {
        "address": address,
        "sysfs_path": "/" + os.path.relpath(real, os.path.realpath(root)),
        "real": real,
        "vendor": vendor,
        "device": device,
        "class": pci_class,
        "pci_id": "%04x:%04x" % (vendor, device) if vendor is not None and device is not None else None,
        "host_bridge": host_bridge,
        "ancestors": ancestors,
        "config": _read_bytes(os.path.join(real, "config")),
    }


def _root_bus_devices(root: str) -> dict[str, dict[str, Any]]:
    """Per host bridge (pciDDDD:BB), the device the kernel's P2PDMA whitelist looks at (pci_host_bridge_dev in
    drivers/pci/p2pdma.c): the first device on the root bus when it is at devfn 00.0 or is a PCIe root port."""
    bridges: dict[str, dict[str, Any]] = {}
    devices_dir = _path(root, "/sys/devices")
    for name in _listdir(devices_dir):
        if not HOST_BRIDGE_DIR.match(name):
            continue
        functions = sorted(entry for entry in _listdir(os.path.join(devices_dir, name)) if PCI_ADDRESS.match(entry))
        entry: dict[str, Any] = {"address": None, "pci_id": None, "reason": "no PCI device on the root bus"}
        if functions:
            first = os.path.join(devices_dir, name, functions[0])
            vendor, device = _read_hex(os.path.join(first, "vendor")), _read_hex(os.path.join(first, "device"))
            pci_id = "%04x:%04x" % (vendor, device) if vendor is not None and device is not None else None
            if functions[0].endswith(":00.0"):
                entry = {"address": functions[0], "pci_id": pci_id, "reason": "devfn 00.0 of the root bus"}
            elif pcie_port_type(_read_bytes(os.path.join(first, "config"))) == "root_port":
                entry = {"address": functions[0], "pci_id": pci_id,
                         "reason": "first device of the root bus is a root port"}
            else:
                entry["reason"] = "first device of the root bus (%s) is neither 00.0 nor a root port" % functions[0]
        bridges[name] = entry
    return bridges


def _link(real: str) -> dict[str, Any]:
    current_speed = _read_text(os.path.join(real, "current_link_speed"))
    max_speed = _read_text(os.path.join(real, "max_link_speed"))
    return {
        "current_speed": current_speed,
        "current_speed_gts": parse_link_speed_gts(current_speed),
        "current_width": _read_int(os.path.join(real, "current_link_width")),
        "max_speed": max_speed,
        "max_speed_gts": parse_link_speed_gts(max_speed),
        "max_width": _read_int(os.path.join(real, "max_link_width")),
    }


def _bridge_entry(root: str, address: str) -> dict[str, Any]:
    bridge = _pci_device(root, address)
    port_type = pcie_port_type(bridge["config"])
    on_board = bridge["vendor"] == INTEL_VENDOR_ID and bridge["device"] in BATTLEMAGE_BOARD_BRIDGE_IDS
    return {
        "address": address,
        "pci_id": bridge["pci_id"],
        "port_type": port_type,
        "on_board": on_board,
        "driver": _link_name(os.path.join(bridge["real"], "driver")),
        "acs": acs_state(bridge["config"]),
        "link": _link(bridge["real"]),
    }


def _bar(real: str, model_vram_gib: float | None) -> dict[str, Any]:
    """BAR 2 is the VRAM aperture of Intel discrete GPUs: 256 MiB = small BAR, VRAM-sized = resizable BAR on."""
    sizes = parse_resource_sizes(_read_text(os.path.join(real, "resource")))
    vram_bar_bytes = sizes.get(2)
    supported = parse_resize_sizes_bytes(_read_text(os.path.join(real, "resource2_resize")))
    if vram_bar_bytes is None:
        state = "unknown"
    elif vram_bar_bytes <= SMALL_BAR_BYTES:
        state = "small"
    elif model_vram_gib is not None and vram_bar_bytes < model_vram_gib * 1024 ** 3:
        state = "partial"
    else:
        state = "full"
    return {
        "vram_bar_bytes": vram_bar_bytes,
        "resizable_bar": state,
        "resizable_sizes_supported_bytes": supported or None,
    }


def _vram_bytes(real: str) -> int | None:
    """xe publishes physical VRAM per tile (tileN/physical_vram_size_bytes, newer kernels under tileN/memory/)."""
    total = 0
    for entry in _listdir(real):
        if not re.match(r"^tile\d+$", entry):
            continue
        for candidate in ("physical_vram_size_bytes", "memory/physical_vram_size_bytes"):
            value = _read_int(os.path.join(real, entry, candidate))
            if value:
                total += value
                break
    return total or None


def _drm_nodes(root: str) -> dict[str, dict[str, str]]:
    """Map resolved PCI device path -> {'card': 'card0', 'render': 'renderD128'} from /sys/class/drm."""
    nodes: dict[str, dict[str, str]] = {}
    drm_dir = _path(root, "/sys/class/drm")
    for name in _listdir(drm_dir):
        kind = "card" if re.match(r"^card\d+$", name) else "render" if re.match(r"^renderD\d+$", name) else None
        if kind is None:
            continue  # connectors (card0-DP-1) and the version file
        device = os.path.realpath(os.path.join(drm_dir, name, "device"))
        nodes.setdefault(device, {})[kind] = name
    return nodes


def _by_path_names(root: str, address: str) -> list[str]:
    prefix = "pci-%s-" % address
    return [name for name in _listdir(_path(root, "/dev/dri/by-path")) if name.startswith(prefix)]


def _uc_firmware(root: str, address: str, card: str | None) -> dict[str, Any] | None:
    """GuC/HuC state from debugfs (root only, mounted at /sys/kernel/debug). The per-device directory is named by
    PCI address on current kernels; older ones use the DRM minor number."""
    candidates = [address]
    if card:
        candidates.append(card[len("card"):])
    for directory in candidates:
        base = _path(root, "/sys/kernel/debug/dri/%s/gt0/uc" % directory)
        guc = parse_uc_info(_read_text(os.path.join(base, "guc_info")))
        huc = parse_uc_info(_read_text(os.path.join(base, "huc_info")))
        if guc or huc:
            return {"guc": guc, "huc": huc}
    return None


def decompress_firmware(blob: bytes, suffix: str) -> bytes | None:
    """The file as the kernel loads it: .xz through lzma, .zst through Python's compression.zstd (3.14) or the
    zstd program (Ubuntu's linux-firmware ships .zst; zstd is in every Ubuntu install, initramfs-tools needs it).
    None when it cannot be read here: its release is then not known, never guessed."""
    if not suffix:
        return blob
    if suffix == ".xz":
        import lzma
        try:
            return lzma.LZMADecompressor().decompress(blob, max_length=MAX_FIRMWARE_BYTES)
        except lzma.LZMAError:
            return None
    if suffix == ".zst":
        try:
            from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14
        except ImportError:
            zstd = None
        if zstd is not None:
            try:
                return bytes(zstd.ZstdDecompressor().decompress(blob, max_length=MAX_FIRMWARE_BYTES))
            except zstd.ZstdError:
                return None
        import shutil
        import subprocess
        program = shutil.which("zstd")
        if program is None:
            return None
        try:
            done = subprocess.run([program, "-dc", "-q"], input=blob, capture_output=True, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 and len(done.stdout) <= MAX_FIRMWARE_BYTES else None
    return None


def uc_release_version(name: str, blob: bytes | None) -> str | None:
    """As the driver's parse_headers: a HuC is read as a CPD directory when it is one, else (and a GuC always) by
    its CSS header."""
    if "_huc" in name and is_cpd_blob(blob):
        return parse_cpd_release_version(blob)
    return parse_css_release_version(blob)


def _firmware_files(root: str, kernel_release: str | None = None) -> dict[str, Any]:
    """Each Battlemage uC file the kernel would load, found in the firmware loader's order, with the release its
    header carries (compressed files decompressed as the kernel does)."""
    directories = [directory.format(release=kernel_release) for directory in FIRMWARE_DIRS
                   if kernel_release or "{release}" not in directory]
    files: dict[str, Any] = {}
    for name in FIRMWARE_FILES:
        entry: dict[str, Any] = {"present": False, "file": None, "path": None, "size_bytes": None,
                                 "release_version": None}
        found = next(((directory, suffix) for suffix in FIRMWARE_SUFFIXES for directory in directories
                      if os.path.isfile(_path(root, "%s/%s%s" % (directory, name, suffix)))), None)
        if found is not None:
            directory, suffix = found
            path = _path(root, "%s/%s%s" % (directory, name, suffix))
            entry.update(present=True, file=name + suffix, path="%s/%s%s" % (directory, name, suffix),
                         size_bytes=os.path.getsize(path))
            blob = _read_bytes(path)
            plain = decompress_firmware(blob, suffix) if blob is not None else None
            entry["release_version"] = uc_release_version(name, plain)
        files[name] = entry
    return files


def classify_integrated(host_bridge: str | None, ancestors: list[str], port_type: str | None) -> tuple[bool, str]:
    """An integrated GPU is part of the root complex: the PCIe capability says 'Root Complex Integrated
    Endpoint' (Intel iGPUs at 00:02.0 do), or, when config space is not visible, the function sits directly on
    the host bridge's root bus with no bridge above it. A discrete card always sits behind at least a root port
    (a B70 behind three bridges: root port, its on-board upstream and downstream ports)."""
    if port_type == "root_complex_integrated_endpoint":
        return True, "PCIe port type is root complex integrated endpoint"
    if port_type is not None:
        return False, "PCIe port type %s" % port_type
    if host_bridge is not None and not ancestors:
        return True, "on the root bus of %s with no bridge above it" % host_bridge
    return False, "behind %d PCI bridge(s)" % len(ancestors)


def _gpu_entry(root: str, device: dict[str, Any], drm: dict[str, dict[str, str]]) -> dict[str, Any]:
    real = device["real"]
    device_id = device["device"]
    model = BATTLEMAGE_MODELS.get(device_id) if device_id is not None else None
    short, marketing, die, vram_gib = model if model else ("unknown", "unknown Intel GPU", None, None)
    port_type = pcie_port_type(device["config"])
    integrated, integrated_reason = classify_integrated(device["host_bridge"], device["ancestors"], port_type)
    driver = _link_name(os.path.join(real, "driver"))
    numa_node = _read_int(os.path.join(real, "numa_node"))
    nodes = drm.get(real, {})
    bridges = [_bridge_entry(root, address) for address in device["ancestors"]]
    on_board = [bridge for bridge in bridges if bridge["on_board"]]
    # Behind the card's own switch the GPU's link is virtual (lspci shows 2.5GT/s, cosmetic): the slot link that
    # matters is the card's upstream port's, the topmost on-board bridge.
    slot_link = on_board[0]["link"] if on_board else _link(real)
    return {
        "pci_address": device["address"],
        "pci_id": device["pci_id"],
        "class": "0x%06x" % device["class"],
        "revision": _read_text(os.path.join(real, "revision")),
        "subsystem_id": "%s:%s" % (
            (_read_text(os.path.join(real, "subsystem_vendor")) or "?").replace("0x", ""),
            (_read_text(os.path.join(real, "subsystem_device")) or "?").replace("0x", ""),
        ),
        "model": short,
        "marketing_name": marketing,
        "die": die,
        "known_model": model is not None,
        "integrated": integrated,
        "integrated_reason": integrated_reason,
        "pcie_port_type": port_type,
        "driver": driver,
        "driver_bound": driver is not None,
        "xe_bound": driver == XE_DRIVER,
        "numa_node": numa_node if numa_node is not None and numa_node >= 0 else None,
        "link": _link(real),
        "slot_link": slot_link,
        "bar": _bar(real, vram_gib),
        "vram_bytes": _vram_bytes(real),
        "vram_gib_nominal": vram_gib,
        "host_bridge": device["host_bridge"],
        "sysfs_path": device["sysfs_path"],
        "parent_bridges": bridges,
        "card": nodes.get("card"),
        "render": nodes.get("render"),
        "dev_nodes": ["/dev/dri/" + nodes[kind] for kind in ("card", "render") if kind in nodes],
        "by_path": _by_path_names(root, device["address"]),
        "firmware": _uc_firmware(root, device["address"], nodes.get("card")),
    }


def _warnings(gpus: list[dict[str, Any]], firmware_files: dict[str, Any]) -> list[str]:
    warnings = []
    for gpu in gpus:
        where = "%s %s" % (gpu["model"], gpu["pci_address"])
        if not gpu["driver_bound"]:
            warnings.append("%s: no driver bound (load the xe module: modprobe xe; check dmesg for firmware)" % where)
        elif not gpu["xe_bound"]:
            warnings.append("%s: bound to %s, not xe (blacklist %s or set xe.force_probe)" % (
                where, gpu["driver"], gpu["driver"]))
        if gpu["bar"]["resizable_bar"] in ("small", "partial"):
            warnings.append("%s: VRAM BAR is %d MiB: enable Resizable BAR (and Above 4G decoding) in the firmware "
                            "setup" % (where, (gpu["bar"]["vram_bar_bytes"] or 0) // 2 ** 20))
        slot = gpu["slot_link"]
        if slot["current_width"] and slot["max_width"] and slot["current_width"] < slot["max_width"]:
            warnings.append("%s: slot link x%d of x%d: reseat the card or use a full-width slot" % (
                where, slot["current_width"], slot["max_width"]))
        guc = (gpu["firmware"] or {}).get("guc") or {}
        found = version_tuple(guc.get("found_release"))
        if found and found < GUC_RECOMMENDED:
            warnings.append("%s: GuC %s loaded, %s+ recommended: update /lib/firmware/xe" % (
                where, guc.get("found_release"), ".".join(map(str, GUC_RECOMMENDED[:2]))))
    if gpus and not all(entry["present"] for entry in firmware_files.values()):
        missing = [name for name, entry in firmware_files.items() if not entry["present"]]
        warnings.append("firmware missing under /lib/firmware: %s (install the linux-firmware of the installer)"
                        % ", ".join(missing))
    return warnings


def collect_facts(root: str = "/", free_space_of: str | None = None) -> dict[str, Any]:
    """Everything the plays and `b70ctl host` need about this host's GPUs, as a JSON-able dict. What could not be
    read is named in `warnings`: a tree without PCI devices, or a device whose identity is unreadable, must not
    pass for a host with no GPU. With `free_space_of` (the model store), also its free space (free_space below)."""
    drm = _drm_nodes(root)
    discrete: list[dict[str, Any]] = []
    integrated: list[dict[str, Any]] = []
    unread: list[str] = []
    devices_dir = _path(root, "/sys/bus/pci/devices")
    if not os.path.isdir(devices_dir):
        unread.append("%s missing: no PCI devices could be read (is %s the root of a sysfs tree?)" % (
            devices_dir, root))
    for address in _listdir(devices_dir):
        if not PCI_ADDRESS.match(address):
            continue
        link = os.path.join(devices_dir, address)
        problem = _link_problem(link)
        if problem is not None:
            unread.append(problem)
            continue
        device = _pci_device(root, address)
        for name in ("vendor", "class"):
            if device[name] is None and (name == "vendor" or device["vendor"] == INTEL_VENDOR_ID):
                unread.append("%s: not known whether it is an Intel GPU, not counted" % _id_file_problem(
                    os.path.join(link, name)))
                break
        if device["vendor"] != INTEL_VENDOR_ID or device["class"] is None or device["class"] >> 16 != 0x03:
            continue  # not an Intel display-class function (bridges e2f0/e2ff and audio e2f7 end here)
        if device["device"] is None:
            unread.append("%s: counted as an unknown Intel GPU" % _id_file_problem(os.path.join(link, "device")))
        entry = _gpu_entry(root, device, drm)
        (integrated if entry["integrated"] else discrete).append(entry)
    for index, gpu in enumerate(discrete):
        gpu["index"] = index
    # Level Zero enumerates only devices a driver exposes, in PCI order: that index is what ZE_AFFINITY_MASK
    # takes.
    for level_zero_index, gpu in enumerate(gpu for gpu in discrete if gpu["xe_bound"]):
        gpu["level_zero_index"] = level_zero_index
    for gpu in discrete:
        gpu.setdefault("level_zero_index", None)
    count_by_model: dict[str, int] = {}
    for gpu in discrete:
        count_by_model[gpu["model"]] = count_by_model.get(gpu["model"], 0) + 1
    kernel_release = _read_text(_path(root, "/proc/sys/kernel/osrelease"))
    firmware_files = _firmware_files(root, kernel_release.strip() if kernel_release else None)
    ram_total_bytes = parse_meminfo_total_bytes(_read_text(_path(root, "/proc/meminfo")))
    facts: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "root": root,
        "kernel_release": kernel_release,
        "ram_total_bytes": ram_total_bytes,
        "ram_total_gib": round(ram_total_bytes / 1024 ** 3, 2) if ram_total_bytes else None,
        "xe_module_loaded": os.path.isdir(_path(root, "/sys/module/xe")),
        "gpu_count": len(discrete),
        "gpu_count_xe_bound": sum(1 for gpu in discrete if gpu["xe_bound"]),
        "gpu_count_by_model": count_by_model,
        "gpu_pci_ids": sorted({gpu["pci_id"] for gpu in discrete if gpu["pci_id"]}),
        "gpus": discrete,
        "integrated_gpus": integrated,
        "firmware_files": firmware_files,
        "warnings": unread + _warnings(discrete, firmware_files),
        # What the kernel's P2PDMA decides with besides the PCIe tree (topology.py).
        "cpu": parse_cpuinfo(_read_text(_path(root, "/proc/cpuinfo"))),
        "host_bridge_devices": _root_bus_devices(root),
    }
    if free_space_of is not None:
        facts["free_space"] = free_space(free_space_of)
    return facts


def free_space(path: str) -> dict[str, Any]:
    """The space a file written to `path` can take: the Available column of `df -P` (f_bavail blocks of
    f_frsize bytes, what an unprivileged writer may use) for the filesystem holding it, or holding its nearest
    existing parent while it is not created yet (the model store, before the first run makes it). A relative path
    is not measured (nothing says what it is relative to on the host): host fit names the setting that gave it."""
    if not os.path.isabs(path):
        return {"path": path, "measured_at": None, "free_bytes": None}
    measured = os.path.abspath(path)
    while not os.path.exists(measured):
        measured = os.path.dirname(measured)
    stats = os.statvfs(measured)
    return {"path": path, "measured_at": measured, "free_bytes": stats.f_bavail * stats.f_frsize}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print this host's Intel GPU inventory as JSON (Ansible fact).")
    parser.add_argument("--root", default="/", help="root prefix of the sysfs/procfs tree to read (default /)")
    parser.add_argument("--free-space-of", metavar="PATH",
                        help="also print the free space for PATH (the model store; a real path, not under --root)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        sys.stderr.write("error: --root %s is not a directory: give the root of a sysfs tree\n" % args.root)
        return 2
    facts = collect_facts(args.root, args.free_space_of)
    for warning in facts["warnings"]:
        sys.stderr.write("warning: %s\n" % warning)  # stdout stays the JSON Ansible reads
    sys.stdout.write(json.dumps(facts, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
