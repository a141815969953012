typedef enum ur_result_t {
  /// Success
  UR_RESULT_SUCCESS = 0,
  /// Invalid operation
  UR_RESULT_ERROR_INVALID_OPERATION = 1,
  /// Invalid queue properties
  UR_RESULT_ERROR_INVALID_QUEUE_PROPERTIES = 2,
  /// Invalid queue
  UR_RESULT_ERROR_INVALID_QUEUE = 3,
  /// Invalid Value
  UR_RESULT_ERROR_INVALID_VALUE = 4,
  /// Invalid context
  UR_RESULT_ERROR_INVALID_CONTEXT = 5,
  /// Invalid platform
  UR_RESULT_ERROR_INVALID_PLATFORM = 6,
  /// Invalid binary
  UR_RESULT_ERROR_INVALID_BINARY = 7,
  /// Invalid program
  UR_RESULT_ERROR_INVALID_PROGRAM = 8,
  /// Invalid sampler
  UR_RESULT_ERROR_INVALID_SAMPLER = 9,
  /// Invalid buffer size
  UR_RESULT_ERROR_INVALID_BUFFER_SIZE = 10,
  /// Invalid memory object
  UR_RESULT_ERROR_INVALID_MEM_OBJECT = 11,
  /// Invalid event
  UR_RESULT_ERROR_INVALID_EVENT = 12,
  /// Returned when the event wait list or the events in the wait list are
  /// invalid.
  UR_RESULT_ERROR_INVALID_EVENT_WAIT_LIST = 13,
  /// Misaligned sub buffer offset
  UR_RESULT_ERROR_MISALIGNED_SUB_BUFFER_OFFSET = 14,
  /// Invalid work group size
  UR_RESULT_ERROR_INVALID_WORK_GROUP_SIZE = 15,
  /// Compiler not available
  UR_RESULT_ERROR_COMPILER_NOT_AVAILABLE = 16,
  /// Profiling info not available
  UR_RESULT_ERROR_PROFILING_INFO_NOT_AVAILABLE = 17,
  /// Device not found
  UR_RESULT_ERROR_DEVICE_NOT_FOUND = 18,
  /// Invalid device
  UR_RESULT_ERROR_INVALID_DEVICE = 19,
  /// Device hung, reset, was removed, or adapter update occurred
  UR_RESULT_ERROR_DEVICE_LOST = 20,
  /// Device requires a reset
  UR_RESULT_ERROR_DEVICE_REQUIRES_RESET = 21,
  /// Device currently in low power state
  UR_RESULT_ERROR_DEVICE_IN_LOW_POWER_STATE = 22,
  /// Device partitioning failed
  UR_RESULT_ERROR_DEVICE_PARTITION_FAILED = 23,
  /// Invalid counts provided with ::UR_DEVICE_PARTITION_BY_COUNTS
  UR_RESULT_ERROR_INVALID_DEVICE_PARTITION_COUNT = 24,
  /// Invalid work item size
  UR_RESULT_ERROR_INVALID_WORK_ITEM_SIZE = 25,
  /// Invalid work dimension
  UR_RESULT_ERROR_INVALID_WORK_DIMENSION = 26,
  /// [deprecated-value] No longer used - invalid kernel args are now UB
  UR_RESULT_ERROR_INVALID_KERNEL_ARGS [[deprecated]] = 27,
  /// Invalid kernel
  UR_RESULT_ERROR_INVALID_KERNEL = 28,
  /// [Validation] kernel name is not found in the program
  UR_RESULT_ERROR_INVALID_KERNEL_NAME = 29,
  /// [Validation] kernel argument index is not valid for kernel
  UR_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_INDEX = 30,
  /// [Validation] kernel argument size does not match kernel
  UR_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_SIZE = 31,
  /// [Validation] value of kernel attribute is not valid for the kernel or
  /// device
  UR_RESULT_ERROR_INVALID_KERNEL_ATTRIBUTE_VALUE = 32,
  /// Invalid image size
  UR_RESULT_ERROR_INVALID_IMAGE_SIZE = 33,
  /// Invalid image format descriptor
  UR_RESULT_ERROR_INVALID_IMAGE_FORMAT_DESCRIPTOR = 34,
  /// Memory object allocation failure
  UR_RESULT_ERROR_MEM_OBJECT_ALLOCATION_FAILURE = 35,
  /// Program object parameter is invalid.
  UR_RESULT_ERROR_INVALID_PROGRAM_EXECUTABLE = 36,
  /// [Validation] adapter is not initialized or specific entry-point is not
  /// implemented
  UR_RESULT_ERROR_UNINITIALIZED = 37,
  /// Insufficient host memory to satisfy call
  UR_RESULT_ERROR_OUT_OF_HOST_MEMORY = 38,
  /// Insufficient device memory to satisfy call
  UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY = 39,
  /// Out of resources
  UR_RESULT_ERROR_OUT_OF_RESOURCES = 40,
  /// Error occurred when building program, see build log for details
  UR_RESULT_ERROR_PROGRAM_BUILD_FAILURE = 41,
  /// Error occurred when linking programs, see build log for details
  UR_RESULT_ERROR_PROGRAM_LINK_FAILURE = 42,
  /// [Validation] generic error code for unsupported versions
  UR_RESULT_ERROR_UNSUPPORTED_VERSION = 43,
  /// [Validation] generic error code for unsupported features
  UR_RESULT_ERROR_UNSUPPORTED_FEATURE = 44,
  /// [Validation] generic error code for invalid arguments
  UR_RESULT_ERROR_INVALID_ARGUMENT = 45,
  /// [Validation] handle argument is not valid
  UR_RESULT_ERROR_INVALID_NULL_HANDLE = 46,
  /// [Validation] object pointed to by handle still in-use by device
  UR_RESULT_ERROR_HANDLE_OBJECT_IN_USE = 47,
  /// [Validation] pointer argument may not be nullptr
  UR_RESULT_ERROR_INVALID_NULL_POINTER = 48,
  /// [Validation] invalid size or dimensions (e.g., must not be zero, or is
  /// out of bounds)
  UR_RESULT_ERROR_INVALID_SIZE = 49,
  /// [Validation] size argument is not supported by the device (e.g., too
  /// large)
  UR_RESULT_ERROR_UNSUPPORTED_SIZE = 50,
  /// [Validation] alignment argument is not supported by the device (e.g.,
  /// too small)
  UR_RESULT_ERROR_UNSUPPORTED_ALIGNMENT = 51,
  /// [Validation] synchronization object in invalid state
  UR_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT = 52,
  /// [Validation] enumerator argument is not valid
  UR_RESULT_ERROR_INVALID_ENUMERATION = 53,
  /// [Validation] enumerator argument is not supported by the device
  UR_RESULT_ERROR_UNSUPPORTED_ENUMERATION = 54,
  /// [Validation] image format is not supported by the device
  UR_RESULT_ERROR_UNSUPPORTED_IMAGE_FORMAT = 55,
  /// [Validation] native binary is not supported by the device
  UR_RESULT_ERROR_INVALID_NATIVE_BINARY = 56,
  /// [Validation] global variable is not found in the program
  UR_RESULT_ERROR_INVALID_GLOBAL_NAME = 57,
  /// [Validation] function name is in the program but its address could not
  /// be determined
  UR_RESULT_ERROR_FUNCTION_ADDRESS_NOT_AVAILABLE = 58,
  /// [Validation] group size dimension is not valid for the kernel or
  /// device
  UR_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION = 59,
  /// [Validation] global width dimension is not valid for the kernel or
  /// device
  UR_RESULT_ERROR_INVALID_GLOBAL_WIDTH_DIMENSION = 60,
  /// [Validation] compiled program or program with imports needs to be
  /// linked before kernels can be created from it.
  UR_RESULT_ERROR_PROGRAM_UNLINKED = 61,
  /// [Validation] copy operations do not support overlapping regions of
  /// memory
  UR_RESULT_ERROR_OVERLAPPING_REGIONS = 62,
  /// Invalid host pointer
  UR_RESULT_ERROR_INVALID_HOST_PTR = 63,
  /// Invalid USM size
  UR_RESULT_ERROR_INVALID_USM_SIZE = 64,
  /// Objection allocation failure
  UR_RESULT_ERROR_OBJECT_ALLOCATION_FAILURE = 65,
  /// An adapter specific warning/error has been reported and can be
  /// retrieved via the urAdapterGetLastError entry point.
  UR_RESULT_ERROR_ADAPTER_SPECIFIC = 66,
  /// A requested layer was not found by the loader.
  UR_RESULT_ERROR_LAYER_NOT_PRESENT = 67,
  /// An event in the provided wait list has ::UR_EVENT_STATUS_ERROR.
  UR_RESULT_ERROR_IN_EVENT_LIST_EXEC_STATUS = 68,
  /// Device in question has `::UR_DEVICE_INFO_AVAILABLE == false`
  UR_RESULT_ERROR_DEVICE_NOT_AVAILABLE = 69,
  /// A specialization constant identifier is not valid.
  UR_RESULT_ERROR_INVALID_SPEC_ID = 70,
  /// A graph object is not valid.
  UR_RESULT_ERROR_INVALID_GRAPH = 71,
  /// An operation is not supported during graph capture.
  UR_RESULT_ERROR_GRAPH_CAPTURE_UNSUPPORTED = 72,
  /// An operation failed and invalidated the graph capture session.
  UR_RESULT_ERROR_GRAPH_CAPTURE_INVALIDATED = 73,
  /// An operation failed because it would merge two graph capture sessions.
  UR_RESULT_ERROR_GRAPH_CAPTURE_MERGE_ATTEMPT = 74,
  /// The command list is not in graph capture mode.
  UR_RESULT_ERROR_COMMAND_LIST_NOT_CAPTURING = 75,
  /// The graph contains unjoined forks.
  UR_RESULT_ERROR_GRAPH_UNJOINED_FORKS = 76,
  /// An operation failed because it uses a graph-internal counter-based
  /// event outside of the graph.
  UR_RESULT_ERROR_GRAPH_INTERNAL_EVENT = 77,
  /// Invalid Command-Buffer
  UR_RESULT_ERROR_INVALID_COMMAND_BUFFER_EXP = 0x1000,
  /// Sync point is not valid for the command-buffer
  UR_RESULT_ERROR_INVALID_COMMAND_BUFFER_SYNC_POINT_EXP = 0x1001,
  /// Sync point wait list is invalid
  UR_RESULT_ERROR_INVALID_COMMAND_BUFFER_SYNC_POINT_WAIT_LIST_EXP = 0x1002,
  /// Handle to command-buffer command is invalid
  UR_RESULT_ERROR_INVALID_COMMAND_BUFFER_COMMAND_HANDLE_EXP = 0x1003,
  /// Unknown or internal error
  UR_RESULT_ERROR_UNKNOWN = 0x7ffffffe,
  /// @cond
  UR_RESULT_FORCE_UINT32 = 0x7fffffff
  /// @endcond

} ur_result_t;
