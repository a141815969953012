/* A stand-in Level Zero loader for the topology tests: the entry points level_zero.py calls, with the layouts
 * of oneapi-src/level-zero include/ze_api.h. Behaviour comes from the environment:
 *   ZE_STUB_INIT_RESULT   zeInit's return value (default 0, ZE_RESULT_SUCCESS)
 *   ZE_STUB_DEVICES       PCI addresses of the GPUs, "0000:03:00.0,0000:07:00.0"
 *   ZE_STUB_PEER_ACCESS   1: every pair can access its peer, 0: none
 *   ZE_STUB_IPC_OPEN      1: zeMemOpenIpcHandle opens a peer's memory, else it returns
 *                         ZE_RESULT_ERROR_INVALID_ARGUMENT (what X570 dual-B70 hosts got, docs/facts.md) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { int32_t stype; void *pNext; int32_t type; uint32_t vendorId; uint32_t deviceId; uint32_t flags;
    uint32_t subdeviceId; uint32_t coreClockRate; uint64_t maxMemAllocSize; uint32_t maxHardwareContexts;
    uint32_t maxCommandQueuePriority; uint32_t numThreadsPerEU; uint32_t physicalEUSimdWidth;
    uint32_t numEUsPerSubslice; uint32_t numSubslicesPerSlice; uint32_t numSlices; uint64_t timerResolution;
    uint32_t timestampValidBits; uint32_t kernelTimestampValidBits; uint8_t uuid[16]; char name[256];
} device_properties;
typedef struct { int32_t stype; void *pNext; uint32_t domain, bus, device, function; int32_t genVersion;
    int32_t width; int64_t maxBandwidth; } pci_properties;
typedef struct { int32_t stype; void *pNext; uint32_t flags; } p2p_properties;

static uint32_t addresses[8][4];
static uintptr_t handles[8];
static uint32_t device_count;
static int driver_token;

int32_t zeInit(uint32_t flags) {
    const char *result = getenv("ZE_STUB_INIT_RESULT");
    const char *devices = getenv("ZE_STUB_DEVICES");
    (void)flags;
    device_count = 0;
    while (devices && *devices && device_count < 8) {
        uint32_t *a = addresses[device_count];
        if (sscanf(devices, "%x:%x:%x.%x", &a[0], &a[1], &a[2], &a[3]) != 4) break;
        handles[device_count] = (uintptr_t)(0x1000 + device_count);
        device_count++;
        devices = strchr(devices, ',');
        if (devices) devices++;
    }
    return result ? (int32_t)strtoul(result, NULL, 0) : 0;
}

int32_t zeDriverGet(uint32_t *count, void **drivers) {
    if (drivers && *count >= 1) drivers[0] = &driver_token;
    *count = 1;
    return 0;
}

int32_t zeDeviceGet(void *driver, uint32_t *count, void **devices) {
    (void)driver;
    if (devices) for (uint32_t i = 0; i < device_count && i < *count; i++) devices[i] = (void *)handles[i];
    *count = device_count;
    return 0;
}

static int index_of(void *device) {
    for (uint32_t i = 0; i < device_count; i++) if ((void *)handles[i] == device) return (int)i;
    return -1;
}

int32_t zeDeviceGetProperties(void *device, device_properties *properties) {
    if (properties->stype != 0x3 || index_of(device) < 0) return 0x78000004; /* invalid argument */
    properties->type = 1;
    properties->vendorId = 0x8086;
    properties->deviceId = 0xe223;
    strcpy(properties->name, "Intel(R) Graphics [0xe223]");
    return 0;
}

int32_t zeDevicePciGetPropertiesExt(void *device, pci_properties *properties) {
    int i = index_of(device);
    if (properties->stype != 0x10008 || i < 0) return 0x78000004;
    properties->domain = addresses[i][0];
    properties->bus = addresses[i][1];
    properties->device = addresses[i][2];
    properties->function = addresses[i][3];
    return 0;
}

static int peer_access(void) {
    const char *value = getenv("ZE_STUB_PEER_ACCESS");
    return value && value[0] == '1';
}

int32_t zeDeviceCanAccessPeer(void *device, void *peer, uint8_t *value) {
    if (index_of(device) < 0 || index_of(peer) < 0) return 0x78000004;
    *value = (uint8_t)peer_access();
    return 0;
}

int32_t zeDeviceGetP2PProperties(void *device, void *peer, p2p_properties *properties) {
    if (properties->stype != 0xb || index_of(device) < 0 || index_of(peer) < 0) return 0x78000004;
    properties->flags = peer_access() ? 0x3 : 0x0;
    return 0;
}

/* The IPC path: one context, one allocation per call, the handle's bytes carry the allocation's address. */
static int context_token;
static char allocation[2 * 1024 * 1024];
typedef struct { char data[64]; } ipc_handle;

int32_t zeContextCreate(void *driver, const void *desc, void **context) {
    if (driver != &driver_token || !desc) return 0x78000004;
    *context = &context_token;
    return 0;
}

int32_t zeContextDestroy(void *context) { return context == &context_token ? 0 : 0x78000004; }

int32_t zeMemAllocDevice(void *context, const void *desc, size_t size, size_t alignment, void *device, void **ptr) {
    (void)alignment;
    if (context != &context_token || !desc || index_of(device) < 0 || size > sizeof(allocation)) return 0x78000004;
    *ptr = allocation;
    return 0;
}

int32_t zeMemFree(void *context, void *ptr) { return context == &context_token && ptr == allocation ? 0 : 0x78000004; }

int32_t zeMemGetIpcHandle(void *context, const void *ptr, ipc_handle *handle) {
    if (context != &context_token || ptr != allocation) return 0x78000004;
    memset(handle->data, 0, sizeof(handle->data));
    memcpy(handle->data, &ptr, sizeof(ptr));
    return 0;
}

int32_t zeMemOpenIpcHandle(void *context, void *device, ipc_handle handle, uint32_t flags, void **ptr) {
    const char *value = getenv("ZE_STUB_IPC_OPEN");
    void *source;
    (void)flags;
    memcpy(&source, handle.data, sizeof(source));
    if (context != &context_token || index_of(device) < 0 || source != allocation) return 0x78000004;
    if (!(value && value[0] == '1')) return 0x78000004;
    *ptr = source;
    return 0;
}

int32_t zeMemCloseIpcHandle(void *context, const void *ptr) {
    return context == &context_token && ptr == allocation ? 0 : 0x78000004;
}
