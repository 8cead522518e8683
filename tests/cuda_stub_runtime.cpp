// A stand-in for the CUDA runtime, linked with the object of csrc/fused_loss.cu instead of
// libcudart (tests/test_cuda_build.py), so that the launchers' host code runs without a GPU or a
// driver: which kernel launch_fused_token_loss chooses, with what, on which stream, and how often
// it sets the cluster kernel's shared-memory attribute. Launches are recorded, never run.
//
// Each stub device answers what a driver answers for the code it loaded from the fatbinary; the
// test derives that from the object's own images (tests/cuda_images.py): the versions that
// cudaFuncGetAttributes reports (ptxVersion = the virtual architecture the code was compiled
// from, binaryVersion = its SASS target) and whether the loaded cluster kernel has its body or is
// the __trap() (a launch of it then "traps": the launch fails and the result says so).
//
// Commands, one a line on stdin; each prints one line of JSON on stdout:
//   device ID CLUSTER_LAUNCH OPTIN_SMEM PTX_VERSION BINARY_VERSION CLUSTER_BODY
//                                 (PTX_VERSION 0: no image of the module loads on it)
//   clusters ID N                 cudaOccupancyMaxActiveClusters answers N on device ID
//                                 (default 16 where it launches clusters, else 0)
//   env VALUE                     FUSEDRL_CUDA_ONE_READ=VALUE ("-": unset)
//   launch ID DTYPE VOCAB [CAP]   launch_fused_token_loss on device ID (DTYPE as fusedrl::DType),
//                                 CAP the soft cap's a (default 0: none)
//   info ID DTYPE                 query_cluster_kernel on device ID
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include "fused_loss.h"

namespace {

// The cluster kernel's static shared memory, as cudaFuncGetAttributes would report it.
constexpr int kStaticSmem = 1440;
constexpr int kDefaultMaxDynamicSmem = 48 * 1024;  // the runtime's limit until it is raised

struct Device {
  int cluster_launch = 0;
  int optin_smem = 0;
  int ptx_version = 0;
  int binary_version = 0;
  bool cluster_body = false;
  std::map<const void*, int> max_dynamic_smem;  // per function, as set by cudaFuncSetAttribute
  int attribute_sets = 0;
  int active_clusters = -1;  // -1: 16 where it launches clusters, else 0
};

struct Launch {
  const void* fun = nullptr;
  std::string kernel = "none";
  const void* stream = nullptr;
  size_t dynamic_smem = 0;
  unsigned cluster_x = 0;
  bool trapped = false;
};

std::map<int, Device> devices;
std::map<const void*, std::string> names;  // host stub -> mangled device function name
int current = 0;
cudaError_t last_error = cudaSuccess;
Launch last_launch;
struct {
  dim3 grid, block;
  size_t smem = 0;
  void* stream = nullptr;
} pushed;

cudaError_t fail(cudaError_t err) {
  last_error = err;
  return err;
}

std::string kind_of(const void* fun) {
  const auto it = names.find(fun);
  if (it == names.end()) return "unregistered";
  if (it->second.find("fused_token_loss_cluster_kernel") != std::string::npos) return "cluster";
  if (it->second.find("fused_token_loss_kernel") != std::string::npos) return "two_sweep";
  return "other";
}

bool is_cluster_kernel(const void* fun) { return kind_of(fun) == "cluster"; }

cudaError_t record(const void* fun, size_t smem, cudaStream_t stream, unsigned cluster_x) {
  Device& d = devices[current];
  last_launch = Launch{fun, kind_of(fun), stream, smem, cluster_x, false};
  if (d.ptx_version == 0) return fail(cudaErrorNoKernelImageForDevice);
  const auto limit = d.max_dynamic_smem.find(fun);
  const int max_smem = limit == d.max_dynamic_smem.end() ? kDefaultMaxDynamicSmem : limit->second;
  if (smem > static_cast<size_t>(max_smem)) return fail(cudaErrorInvalidValue);
  if (cluster_x > 1 && d.cluster_launch == 0) return fail(cudaErrorInvalidConfiguration);
  if (is_cluster_kernel(fun) && !d.cluster_body) {
    last_launch.trapped = true;  // on a GPU: an illegal instruction, the context is lost
    return fail(cudaErrorLaunchFailure);
  }
  return cudaSuccess;
}

}  // namespace

// ------------------------------------------------------------------ what nvcc's host code calls
extern "C" {

void** __cudaRegisterFatBinary(void*) {
  static void* handle = nullptr;
  return &handle;
}
void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {}
void __cudaRegisterFunction(void**, const char* host_fun, char*, const char* device_name, int,
                            uint3*, uint3*, dim3*, dim3*, int*) {
  names[host_fun] = device_name;
}
void __cudaRegisterVar(void**, char*, char*, const char*, int, size_t, int, int) {}

unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t smem, struct CUstream_st* s) {
  pushed.grid = grid;
  pushed.block = block;
  pushed.smem = smem;
  pushed.stream = s;
  return 0;
}
cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* smem, void* stream) {
  *grid = pushed.grid;
  *block = pushed.block;
  *smem = pushed.smem;
  *static_cast<void**>(stream) = pushed.stream;
  return cudaSuccess;
}

// <<<...>>> launches: CUDA 13 resolves a handle once (__cudaGetKernel), CUDA 12 passes the stub
// to cudaLaunchKernel (below).
#if CUDART_VERSION >= 12000
cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* fun) {
  *kernel = reinterpret_cast<cudaKernel_t>(const_cast<void*>(fun));
  return cudaSuccess;
}
cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3, dim3, void**, size_t smem,
                               cudaStream_t stream) {
  return record(reinterpret_cast<const void*>(kernel), smem, stream, 1);
}
cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t kernel, dim3 grid, dim3 block, void** args,
                                    size_t smem, cudaStream_t stream) {
  return __cudaLaunchKernel(kernel, grid, block, args, smem, stream);
}
#endif

}  // extern "C"

// ------------------------------------------------------------------ runtime API
cudaError_t cudaLaunchKernel(const void* fun, dim3, dim3, void**, size_t smem,
                             cudaStream_t stream) {
  return record(fun, smem, stream, 1);
}

cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* config, const void* fun, void**) {
  unsigned cluster_x = 1;
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    if (config->attrs[i].id == cudaLaunchAttributeClusterDimension) {
      cluster_x = config->attrs[i].val.clusterDim.x;
    }
  }
  return record(fun, config->dynamicSmemBytes, config->stream, cluster_x);
}

cudaError_t cudaGetDevice(int* device) {
  *device = current;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t err = last_error;
  last_error = cudaSuccess;
  return err;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  const Device& d = devices[device];
  switch (attr) {
    case cudaDevAttrClusterLaunch:
      *value = d.cluster_launch;
      break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = d.optin_smem;
      break;
    case cudaDevAttrComputeCapabilityMajor:
      *value = d.binary_version / 10;
      break;
    case cudaDevAttrMultiProcessorCount:
      *value = 132;
      break;
    case cudaDevAttrL2CacheSize:
      *value = 50 << 20;
      break;
    default:
      *value = 0;
  }
  return cudaSuccess;
}

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* fun) {
  const Device& d = devices[current];
  if (d.ptx_version == 0) return fail(cudaErrorNoKernelImageForDevice);
  *attr = cudaFuncAttributes{};
  attr->ptxVersion = d.ptx_version;
  attr->binaryVersion = d.binary_version;
  attr->sharedSizeBytes = is_cluster_kernel(fun) ? kStaticSmem : 0;
  const auto limit = d.max_dynamic_smem.find(fun);
  attr->maxDynamicSharedSizeBytes =
      limit == d.max_dynamic_smem.end() ? kDefaultMaxDynamicSmem : limit->second;
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* fun, cudaFuncAttribute attr, int value) {
  Device& d = devices[current];
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  ++d.attribute_sets;
  const int static_smem = is_cluster_kernel(fun) ? kStaticSmem : 0;
  if (value < 0 || value + static_smem > d.optin_smem) return fail(cudaErrorInvalidValue);
  d.max_dynamic_smem[fun] = value;
  return cudaSuccess;
}

cudaError_t cudaOccupancyMaxActiveClusters(int* clusters, const void*,
                                           const cudaLaunchConfig_t*) {
  const Device& d = devices[current];
  *clusters = d.active_clusters >= 0 ? d.active_clusters : (d.cluster_launch != 0 ? 16 : 0);
  return cudaSuccess;
}

// ------------------------------------------------------------------ the driver of the stub
namespace {

void launch(int device, int dtype, int64_t vocab, float cap) {
  current = device;
  const int64_t rows = 4;
  const fusedrl::RowLayout layout{rows, rows, vocab, rows * vocab, vocab};
  // Never dereferenced: the stub records launches and runs none.
  static char storage[64];
  const auto* labels = reinterpret_cast<const int64_t*>(storage);
  const auto* valid = reinterpret_cast<const int8_t*>(storage);
  const auto* floats = reinterpret_cast<const float*>(storage);
  const fusedrl::TokenLossInputs inputs{labels, valid,  floats,  floats, floats,
                                        floats, floats, floats, floats};
  fusedrl::TokenLossParams params{};
  params.read.cap = cap;
  auto* out = reinterpret_cast<float*>(storage);
  // A stream per device, so that the test sees the launch went to the one it passed.
  auto* stream = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(0x5000 + device));
  last_launch = Launch{};
  const cudaError_t err = fusedrl::launch_fused_token_loss(
      storage, storage, static_cast<fusedrl::DType>(dtype), layout, layout, inputs, params, out,
      out, stream);
  const Device& d = devices[device];
  const auto set = d.max_dynamic_smem.find(last_launch.fun);
  const int limit = set == d.max_dynamic_smem.end() ? 0 : set->second;
  // The soft-capped instantiation <T, kCap = true>, by its mangled name.
  const auto name = names.find(last_launch.fun);
  const bool capped = name != names.end() && name->second.find("Lb1EE") != std::string::npos;
  std::printf(
      "{\"kernel\": \"%s\", \"trapped\": %s, \"stream_ok\": %s, \"dynamic_smem\": %zu, "
      "\"cluster\": %u, \"error\": %d, \"attribute_sets\": %d, \"max_dynamic_smem\": %d, "
      "\"capped\": %s}\n",
      last_launch.kernel.c_str(), last_launch.trapped ? "true" : "false",
      last_launch.stream == stream ? "true" : "false", last_launch.dynamic_smem,
      last_launch.cluster_x, static_cast<int>(err), d.attribute_sets, limit,
      capped ? "true" : "false");
}

void info(int device, int dtype) {
  current = device;
  fusedrl::ClusterKernelInfo info{};
  const cudaError_t err =
      fusedrl::query_cluster_kernel(static_cast<fusedrl::DType>(dtype), &info);
  std::printf(
      "{\"available\": %s, \"ptx_version\": %d, \"binary_version\": %d, "
      "\"max_dynamic_smem\": %d, \"attribute_sets\": %d, \"error\": %d}\n",
      info.available ? "true" : "false", info.ptx_version, info.binary_version,
      info.max_dynamic_smem, info.attribute_sets, static_cast<int>(err));
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string command;
    in >> command;
    if (command == "device") {
      int id = 0, body = 0;
      Device d;
      in >> id >> d.cluster_launch >> d.optin_smem >> d.ptx_version >> d.binary_version >> body;
      d.cluster_body = body != 0;
      devices[id] = d;
      std::printf("{}\n");
    } else if (command == "clusters") {
      int id = 0, n = 0;
      in >> id >> n;
      devices[id].active_clusters = n;
      std::printf("{}\n");
    } else if (command == "env") {
      std::string value;
      in >> value;
      if (value == "-") {
        unsetenv("FUSEDRL_CUDA_ONE_READ");
      } else {
        setenv("FUSEDRL_CUDA_ONE_READ", value.c_str(), 1);
      }
      std::printf("{}\n");
    } else if (command == "launch") {
      int id = 0, dtype = 0;
      int64_t vocab = 0;
      float cap = 0.f;
      in >> id >> dtype >> vocab;
      in >> cap;  // optional: the soft cap's a (0: none)
      launch(id, dtype, vocab, cap);
    } else if (command == "info") {
      int id = 0, dtype = 0;
      in >> id >> dtype;
      info(id, dtype);
    } else if (!command.empty()) {
      std::fprintf(stderr, "unknown command: %s\n", line.c_str());
      return 2;
    }
    std::fflush(stdout);
  }
  return 0;
}
