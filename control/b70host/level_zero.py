#!/usr/bin/env python3
"""Peer access between GPUs as the Level Zero loader answers it: the question oneCCL's topology manager asks.

STANDARD LIBRARY ONLY (ctypes), installed next to facts.py and topology.py on hosts. The loader is the
libze_loader.so.1 the compute runtime installs (package libze1); B70CTL_ZE_LOADER picks another file (tests load
a stub built from tests/unit/ze_loader_stub.c through this same code).

Signatures, structure layouts and values below are those of oneapi-src/level-zero include/ze_api.h (1.x):
  ze_result_t zeInit(ze_init_flags_t flags)                                  ZE_INIT_FLAG_GPU_ONLY = 1
  ze_result_t zeDriverGet(uint32_t* pCount, ze_driver_handle_t* phDrivers)
  ze_result_t zeDeviceGet(ze_driver_handle_t, uint32_t* pCount, ze_device_handle_t* phDevices)
  ze_result_t zeDeviceGetProperties(ze_device_handle_t, ze_device_properties_t*)        stype 0x3
  ze_result_t zeDevicePciGetPropertiesExt(ze_device_handle_t, ze_pci_ext_properties_t*) stype 0x10008
  ze_result_t zeDeviceCanAccessPeer(ze_device_handle_t, ze_device_handle_t hPeer, ze_bool_t* value)
  ze_result_t zeDeviceGetP2PProperties(ze_device_handle_t, ze_device_handle_t hPeer, ze_device_p2p_properties_t*)
                                                                             stype 0xb; flags ACCESS = 1, ATOMICS = 2
ze_result_t is a 32-bit enum (ZE_RESULT_SUCCESS = 0), ze_bool_t a uint8_t, handles are pointers.

zeDeviceCanAccessPeer said yes on X570 dual-B70 hosts whose TP=2 start then died at zeMemOpenIpcHandle
INVALID_ARGUMENT (https://github.com/SergiioB/intel-arc-pro-b70-inference-cookbook/issues/8), so a pair it allows
is then opened the way oneCCL's IPC path does: memory allocated on one device, its IPC handle opened on the other,
and back (peer_memory_opened):
  ze_result_t zeContextCreate(ze_driver_handle_t, const ze_context_desc_t*, ze_context_handle_t*)  stype 0xd
  ze_result_t zeMemAllocDevice(ze_context_handle_t, const ze_device_mem_alloc_desc_t*, size_t size,
                               size_t alignment, ze_device_handle_t, void** pptr)                 stype 0x15
  ze_result_t zeMemGetIpcHandle(ze_context_handle_t, const void* ptr, ze_ipc_mem_handle_t*)  (char data[64])
  ze_result_t zeMemOpenIpcHandle(ze_context_handle_t, ze_device_handle_t, ze_ipc_mem_handle_t (by value),
                                 ze_ipc_memory_flags_t, void** pptr)
  ze_result_t zeMemCloseIpcHandle(ze_context_handle_t, const void*), zeMemFree(ze_context_handle_t, void*),
              zeContextDestroy(ze_context_handle_t)
This opens the handle in this one process; oneCCL's ranks are separate processes, so a pass here is the least
the pair must do (ze_peer across processes is the stronger test), a failure here is the field's failure.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

LOADER_ENV = "B70CTL_ZE_LOADER"
LOADER_NAME = "libze_loader.so.1"

ZE_RESULT_SUCCESS = 0
ZE_RESULT_NAMES = {
    0x70000001: "ZE_RESULT_ERROR_DEVICE_LOST",
    0x78000001: "ZE_RESULT_ERROR_UNINITIALIZED",
    0x78000003: "ZE_RESULT_ERROR_UNSUPPORTED_FEATURE",
    0x78000004: "ZE_RESULT_ERROR_INVALID_ARGUMENT",
}
ZE_INIT_FLAG_GPU_ONLY = 1
ZE_DEVICE_TYPE_GPU = 1
ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES = 0x3
ZE_STRUCTURE_TYPE_DEVICE_P2P_PROPERTIES = 0xB
ZE_STRUCTURE_TYPE_PCI_EXT_PROPERTIES = 0x10008
ZE_DEVICE_P2P_PROPERTY_FLAG_ACCESS = 1
ZE_DEVICE_P2P_PROPERTY_FLAG_ATOMICS = 2
ZE_STRUCTURE_TYPE_CONTEXT_DESC = 0xD
ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC = 0x15
ZE_MAX_IPC_HANDLE_SIZE = 64
PROBE_ALLOCATION_BYTES = 2 * 1024 * 1024  # one 2 MiB page: small, and the size oneCCL's buffers are rounded to


class DeviceProperties(ctypes.Structure):
    """ze_device_properties_t."""

    _fields_ = [
        ("stype", ctypes.c_int32), ("pNext", ctypes.c_void_p), ("type", ctypes.c_int32),
        ("vendorId", ctypes.c_uint32), ("deviceId", ctypes.c_uint32), ("flags", ctypes.c_uint32),
        ("subdeviceId", ctypes.c_uint32), ("coreClockRate", ctypes.c_uint32), ("maxMemAllocSize", ctypes.c_uint64),
        ("maxHardwareContexts", ctypes.c_uint32), ("maxCommandQueuePriority", ctypes.c_uint32),
        ("numThreadsPerEU", ctypes.c_uint32), ("physicalEUSimdWidth", ctypes.c_uint32),
        ("numEUsPerSubslice", ctypes.c_uint32), ("numSubslicesPerSlice", ctypes.c_uint32),
        ("numSlices", ctypes.c_uint32), ("timerResolution", ctypes.c_uint64),
        ("timestampValidBits", ctypes.c_uint32), ("kernelTimestampValidBits", ctypes.c_uint32),
        ("uuid", ctypes.c_uint8 * 16), ("name", ctypes.c_char * 256),
    ]


class PciAddress(ctypes.Structure):
    """ze_pci_address_ext_t."""

    _fields_ = [("domain", ctypes.c_uint32), ("bus", ctypes.c_uint32), ("device", ctypes.c_uint32),
                ("function", ctypes.c_uint32)]


class PciSpeed(ctypes.Structure):
    """ze_pci_speed_ext_t."""

    _fields_ = [("genVersion", ctypes.c_int32), ("width", ctypes.c_int32), ("maxBandwidth", ctypes.c_int64)]


class PciProperties(ctypes.Structure):
    """ze_pci_ext_properties_t."""

    _fields_ = [("stype", ctypes.c_int32), ("pNext", ctypes.c_void_p), ("address", PciAddress),
                ("maxSpeed", PciSpeed)]


class P2PProperties(ctypes.Structure):
    """ze_device_p2p_properties_t."""

    _fields_ = [("stype", ctypes.c_int32), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32)]


class ContextDesc(ctypes.Structure):
    """ze_context_desc_t."""

    _fields_ = [("stype", ctypes.c_int32), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32)]


class DeviceMemAllocDesc(ctypes.Structure):
    """ze_device_mem_alloc_desc_t."""

    _fields_ = [("stype", ctypes.c_int32), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("ordinal", ctypes.c_uint32)]


class IpcMemHandle(ctypes.Structure):
    """ze_ipc_mem_handle_t."""

    _fields_ = [("data", ctypes.c_char * ZE_MAX_IPC_HANDLE_SIZE)]


class LevelZeroUnavailable(Exception):
    """The loader is missing or does not initialise: the caller falls back to the kernel's rule."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def result_name(code: int) -> str:
    return ZE_RESULT_NAMES.get(code & 0xFFFFFFFF, "ze_result_t 0x%08x" % (code & 0xFFFFFFFF))


def loader_path(explicit: str | None = None) -> str:
    return explicit or os.environ.get(LOADER_ENV) or LOADER_NAME


def _load(path: str) -> Any:
    try:
        library = ctypes.CDLL(path)
    except OSError as error:
        raise LevelZeroUnavailable("not_installed", "Level Zero loader %s not found (%s): install the compute "
                                                    "runtime's libze1" % (path, error)) from error
    handle = ctypes.c_void_p
    signatures = {
        "zeInit": [ctypes.c_uint32],
        "zeDriverGet": [ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(handle)],
        "zeDeviceGet": [handle, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(handle)],
        "zeDeviceGetProperties": [handle, ctypes.POINTER(DeviceProperties)],
        "zeDevicePciGetPropertiesExt": [handle, ctypes.POINTER(PciProperties)],
        "zeDeviceCanAccessPeer": [handle, handle, ctypes.POINTER(ctypes.c_uint8)],
        "zeDeviceGetP2PProperties": [handle, handle, ctypes.POINTER(P2PProperties)],
        "zeContextCreate": [handle, ctypes.POINTER(ContextDesc), ctypes.POINTER(handle)],
        "zeContextDestroy": [handle],
        "zeMemAllocDevice": [handle, ctypes.POINTER(DeviceMemAllocDesc), ctypes.c_size_t, ctypes.c_size_t, handle,
                             ctypes.POINTER(handle)],
        "zeMemFree": [handle, handle],
        "zeMemGetIpcHandle": [handle, handle, ctypes.POINTER(IpcMemHandle)],
        "zeMemOpenIpcHandle": [handle, handle, IpcMemHandle, ctypes.c_uint32, ctypes.POINTER(handle)],
        "zeMemCloseIpcHandle": [handle, handle],
    }
    for name, argtypes in signatures.items():
        try:
            function = getattr(library, name)
        except AttributeError as error:
            raise LevelZeroUnavailable("not_installed", "%s does not export %s: not a Level Zero loader" % (
                path, name)) from error
        function.argtypes = argtypes
        function.restype = ctypes.c_int32
    return library


def _check(code: int, call: str) -> None:
    if code != ZE_RESULT_SUCCESS:
        raise LevelZeroUnavailable("failed", "%s returned %s" % (call, result_name(code)))


def _gpu_devices(library: Any, drivers_by_device: dict[Any, Any]) -> list[tuple[Any, str, str]]:
    """(handle, PCI address, vendor:device) of every GPU of every driver; drivers_by_device gets each one's driver."""
    count = ctypes.c_uint32(0)
    _check(library.zeDriverGet(ctypes.byref(count), None), "zeDriverGet")
    drivers = (ctypes.c_void_p * count.value)()
    _check(library.zeDriverGet(ctypes.byref(count), drivers), "zeDriverGet")
    devices: list[tuple[Any, str, str]] = []
    for driver in drivers[:count.value]:
        device_count = ctypes.c_uint32(0)
        _check(library.zeDeviceGet(driver, ctypes.byref(device_count), None), "zeDeviceGet")
        handles = (ctypes.c_void_p * device_count.value)()
        _check(library.zeDeviceGet(driver, ctypes.byref(device_count), handles), "zeDeviceGet")
        for device in handles[:device_count.value]:
            properties = DeviceProperties(stype=ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES)
            _check(library.zeDeviceGetProperties(device, ctypes.byref(properties)), "zeDeviceGetProperties")
            if properties.type != ZE_DEVICE_TYPE_GPU:
                continue
            pci = PciProperties(stype=ZE_STRUCTURE_TYPE_PCI_EXT_PROPERTIES)
            _check(library.zeDevicePciGetPropertiesExt(device, ctypes.byref(pci)), "zeDevicePciGetPropertiesExt")
            address = "%04x:%02x:%02x.%x" % (pci.address.domain, pci.address.bus, pci.address.device,
                                             pci.address.function)
            devices.append((device, address, "%04x:%04x" % (properties.vendorId, properties.deviceId)))
            drivers_by_device[device] = driver
    return devices


def peer_access(pci_pairs: list[tuple[str, str]], library_path: str | None = None
                ) -> dict[tuple[str, str], dict[str, Any]]:
    """For each (PCI address A, PCI address B): what the loader says about A accessing B and B accessing A.
    Raises LevelZeroUnavailable (status not_installed / init_failed / failed) when it cannot be asked."""
    path = loader_path(library_path)
    library = _load(path)
    code = library.zeInit(ZE_INIT_FLAG_GPU_ONLY)
    if code != ZE_RESULT_SUCCESS:
        raise LevelZeroUnavailable("init_failed", "zeInit(ZE_INIT_FLAG_GPU_ONLY) returned %s (is the xe driver "
                                                  "loaded and /dev/dri/renderD* readable?)" % result_name(code))
    drivers: dict[Any, Any] = {}
    by_address = {address: handle for handle, address, _ in _gpu_devices(library, drivers)}
    answers: dict[tuple[str, str], dict[str, Any]] = {}
    for a, b in pci_pairs:
        if a not in by_address or b not in by_address:
            missing = [address for address in (a, b) if address not in by_address]
            answers[(a, b)] = {"status": "inconclusive", "detail": "Level Zero does not list %s" % ", ".join(missing)}
            continue
        directions = []
        for source, target in ((a, b), (b, a)):
            value = ctypes.c_uint8(0)
            _check(library.zeDeviceCanAccessPeer(by_address[source], by_address[target], ctypes.byref(value)),
                   "zeDeviceCanAccessPeer")
            p2p = P2PProperties(stype=ZE_STRUCTURE_TYPE_DEVICE_P2P_PROPERTIES)
            _check(library.zeDeviceGetP2PProperties(by_address[source], by_address[target], ctypes.byref(p2p)),
                   "zeDeviceGetP2PProperties")
            directions.append((bool(value.value), bool(p2p.flags & ZE_DEVICE_P2P_PROPERTY_FLAG_ACCESS),
                               bool(p2p.flags & ZE_DEVICE_P2P_PROPERTY_FLAG_ATOMICS)))
        access = all(can and flag for can, flag, _ in directions)
        detail = "; ".join("%s->%s zeDeviceCanAccessPeer=%s p2p flags access=%s atomics=%s" % (
            source, target, can, flag, atomics) for (source, target), (can, flag, atomics) in zip(
                ((a, b), (b, a)), directions))
        opened = False
        if access:
            failure = None
            for source, target in ((a, b), (b, a)):
                failure = _open_peer_memory(library, drivers[by_address[source]], by_address[source],
                                            by_address[target])
                if failure:
                    detail += "; %s memory opened on %s: %s" % (source, target, failure)
                    break
            opened = failure is None
            if opened:
                detail += "; IPC handles of %d-byte allocations opened on the peer both ways" % PROBE_ALLOCATION_BYTES
        # A pair the runtime allows but whose memory does not open is the field's failure: refused, not confirmed.
        answers[(a, b)] = {"status": "confirmed" if access and opened else "refused", "detail": detail,
                           "peer_memory_opened": opened}
    return answers


def _open_peer_memory(library: Any, driver: Any, owner: Any, peer: Any) -> str | None:
    """Allocate on owner, open its IPC handle on peer, release everything: None when it opened, else the failure."""
    context = ctypes.c_void_p()
    code = library.zeContextCreate(driver, ctypes.byref(ContextDesc(stype=ZE_STRUCTURE_TYPE_CONTEXT_DESC)),
                                   ctypes.byref(context))
    if code != ZE_RESULT_SUCCESS:
        return "zeContextCreate returned %s" % result_name(code)
    memory, mapped = ctypes.c_void_p(), ctypes.c_void_p()
    try:
        code = library.zeMemAllocDevice(context, ctypes.byref(DeviceMemAllocDesc(
            stype=ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC)), PROBE_ALLOCATION_BYTES, 0, owner, ctypes.byref(memory))
        if code != ZE_RESULT_SUCCESS:
            return "zeMemAllocDevice returned %s" % result_name(code)
        handle = IpcMemHandle()
        code = library.zeMemGetIpcHandle(context, memory, ctypes.byref(handle))
        if code != ZE_RESULT_SUCCESS:
            return "zeMemGetIpcHandle returned %s" % result_name(code)
        code = library.zeMemOpenIpcHandle(context, peer, handle, 0, ctypes.byref(mapped))
        if code != ZE_RESULT_SUCCESS:
            return "zeMemOpenIpcHandle returned %s" % result_name(code)
        return None
    finally:
        if mapped.value:
            library.zeMemCloseIpcHandle(context, mapped)
        if memory.value:
            library.zeMemFree(context, memory)
        library.zeContextDestroy(context)
