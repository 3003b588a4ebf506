// The DLPack ABI (versions 0.8 and 1.x) as the module exchanges it: the structs, type codes,
// flags and capsule names of the DLPack specification, written out here so that the module
// needs no copy of another project's header. Layouts must match the specification exactly.
#pragma once
#include <cstdint>

namespace kiln::python::dlpack {

enum DeviceType : int32_t { kCPU = 1, kCUDA = 2, kCUDAHost = 3, kCUDAManaged = 13 };
enum TypeCode : uint8_t {
  kInt = 0, kUInt = 1, kFloat = 2, kOpaque = 3, kBfloat = 4, kComplex = 5, kBool = 6,
  kFloat8_e4m3fn = 10, kFloat8_e5m2 = 12,  // DLPack 1.1
};

struct Device {
  int32_t device_type;
  int32_t device_id;
};
struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};
// Pre-1.0 capsules ("dltensor").
struct ManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};
struct Version {
  uint32_t major;
  uint32_t minor;
};
inline constexpr uint64_t kFlagReadOnly = 1ull << 0;
inline constexpr uint64_t kFlagIsCopied = 1ull << 1;
// 1.x capsules ("dltensor_versioned").
struct ManagedTensorVersioned {
  Version version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
};

inline constexpr uint32_t kMajor = 1, kMinor = 1;  // what kiln produces
inline constexpr const char* kCapsule = "dltensor";
inline constexpr const char* kUsedCapsule = "used_dltensor";
inline constexpr const char* kCapsuleVersioned = "dltensor_versioned";
inline constexpr const char* kUsedCapsuleVersioned = "used_dltensor_versioned";

}  // namespace kiln::python::dlpack
