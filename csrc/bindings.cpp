// Torch bindings of the fusedrl CUDA kernels: ops in the `fusedrl` namespace (TORCH_LIBRARY), so
// that they dispatch like any aten op and work under torch.compile (fake implementations are
// registered from Python in fusedrl/kernels/cuda.py). Every argument is checked here with a
// message that names it; the kernels themselves (fused_loss.cu) see only raw pointers.
//
// Only the headers used: torch/extension.h (all of the C++ frontend and pybind11) took 24 s of a
// syntax check that these pass in 7, and as much of every JIT build; the module is a plain
// CPython one, since the ops register through TORCH_LIBRARY and Python calls nothing in it.
#include <Python.h>  // first, as CPython asks

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cfloat>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fused_loss.h"

namespace fusedrl {
namespace {

// Numbers and shapes go into error messages as strings made here, never through an ostream:
// JIT builds on a machine whose compiler is newer than the process's libstdc++ (the H100 image:
// /opt/gcc) inline the newer ostream's integer formatting, which reads the older library's
// locale facets at the wrong offsets and crashes (seen: a segfault in _M_insert<long> under
// c10::str, 2026-11-25). std::to_string involves no locale.
std::string num(int64_t value) { return std::to_string(value); }

std::string dims(at::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "fusedrl: launching ", what, " failed: ",
              cudaGetErrorString(err));
}

DType dtype_of(at::ScalarType type, const char* name) {
  switch (type) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "fusedrl: ", name, " must be float32, float16 or bfloat16, got ", type);
  }
  return DType::kFloat32;  // unreachable
}

RowLayout layout_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "fusedrl: ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 3, "fusedrl: ", name, " must be [B, T, V], got shape ",
              dims(t.sizes()));
  TORCH_CHECK(t.size(2) > 0, "fusedrl: ", name, " has an empty vocab dimension");
  // In-row indices are 32-bit in the kernels (row offsets stay 64-bit).
  TORCH_CHECK(t.size(2) <= INT32_MAX / 2, "fusedrl: ", name, " has a vocab dimension of ",
              num(t.size(2)), "; at most ", num(INT32_MAX / 2), " is supported");
  TORCH_CHECK(t.size(2) == 1 || t.stride(2) == 1, "fusedrl: ", name,
              " must be contiguous in its vocab dimension, got strides ", dims(t.strides()));
  return RowLayout{t.size(0) * t.size(1), t.size(1), t.size(2), t.stride(0), t.stride(1)};
}

// Every tensor argument on the logits' device (type and index): the kernels run there and would
// otherwise dereference another device's pointers (an illegal address, or silent peer traffic).
void check_device(const at::Tensor& t, const at::Tensor& logits, const char* name) {
  TORCH_CHECK(t.device() == logits.device(), "fusedrl: ", name, " is on ", t.device(),
              " but logits are on ", logits.device(),
              "; every tensor argument must be on the logits' device");
}

// A per-token tensor: [B, T] like labels, on the logits' device; returned as contiguous fp32.
at::Tensor per_token(const at::Tensor& t, const at::Tensor& labels, const at::Tensor& logits,
                     const char* name) {
  check_device(t, logits, name);
  TORCH_CHECK(t.sizes() == labels.sizes(), "fusedrl: ", name, " shape ", dims(t.sizes()),
              " must equal labels shape ", dims(labels.sizes()));
  return t.to(at::kFloat).contiguous();
}

std::optional<at::Tensor> per_token(const std::optional<at::Tensor>& t, const at::Tensor& labels,
                                    const at::Tensor& logits, const char* name) {
  if (!t.has_value()) return std::nullopt;
  return per_token(*t, labels, logits, name);
}

const float* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// How the kernels read the rows (fused_loss.h, RowRead): `temperature` unless per-token
// temperatures `row_temps` ([B, T], kept alive by the caller until the launch is queued), and
// the soft cap's a (y = c tanh(a x) read at T / c: fusedrl.fused_backend.temperature_keywords).
RowRead row_read(double temperature, const std::optional<at::Tensor>& row_temps,
                 std::optional<double> cap) {
  // A cap that is not a normal fp32 number would read as inf (NaN at x = 0) or as 0 (the
  // uncapped kernel at the capped temperature): fusedrl.logit_transform refuses both by name.
  TORCH_CHECK(!cap.has_value() || (std::isfinite(static_cast<float>(*cap)) &&
                                   static_cast<float>(*cap) >= FLT_MIN),
              "fusedrl: cap must be a normal float32 number > 0 (the soft cap's s / c)");
  return RowRead{static_cast<float>(1.0 / temperature), data_or_null(row_temps),
                 static_cast<float>(cap.value_or(0.0))};
}

// The current stream of the logits' device (not of the caller's current device).
cudaStream_t stream_of(const at::Tensor& logits) {
  return c10::cuda::getCurrentCUDAStream(logits.device().index()).stream();
}

at::Tensor checked_labels(const at::Tensor& labels, const at::Tensor& logits) {
  check_device(labels, logits, "labels");
  TORCH_CHECK(labels.scalar_type() == at::kLong, "fusedrl: labels must be int64, got ",
              labels.scalar_type());
  TORCH_CHECK(labels.dim() == 2 && labels.size(0) == logits.size(0) &&
                  labels.size(1) == logits.size(1),
              "fusedrl: labels shape ", dims(labels.sizes()), " must be [B, T] of logits ",
              dims(logits.sizes()));
  return labels.contiguous();
}

at::Tensor checked_valid(const at::Tensor& valid, const at::Tensor& labels,
                         const at::Tensor& logits) {
  check_device(valid, logits, "valid");
  TORCH_CHECK(valid.sizes() == labels.sizes(), "fusedrl: valid shape ", dims(valid.sizes()),
              " must equal labels shape ", dims(labels.sizes()));
  return valid.to(at::kChar).contiguous();
}

int loss_code(const std::string& loss) {
  if (loss == "ppo" || loss == "dcpo") return kLossClipped;
  if (loss == "cispo") return kLossCispo;
  if (loss == "sapo") return kLossSapo;
  if (loss == "pg") return kLossPg;
  TORCH_CHECK(false, "fusedrl: loss '", loss, "' has no token-level CUDA kernel");
  return -1;  // unreachable
}

int kl_code(const std::optional<std::string>& kl, double beta) {
  if (!kl.has_value() || beta <= 0) return kKlNone;
  if (*kl == "k1") return kKlK1;
  if (*kl == "k2") return kKlK2;
  if (*kl == "abs") return kKlAbs;
  if (*kl == "k3") return kKlK3;
  if (*kl == "k1+" || *kl == "k3+") return kKlStraightThrough;
  TORCH_CHECK(false, "fusedrl: unknown kl estimator '", *kl, "'");
  return -1;  // unreachable
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> logprobs_fwd(
    const at::Tensor& logits, const at::Tensor& labels_in, const std::optional<at::Tensor>& valid,
    double temperature, const std::optional<at::Tensor>& row_temps, std::optional<double> cap) {
  const RowLayout layout = layout_of(logits, "logits");
  // The launch on the logits' device and that device's current stream, whatever device is
  // current in the caller (allocations follow logits.options() regardless).
  const c10::cuda::CUDAGuard device_guard(logits.device());
  const at::Tensor labels = checked_labels(labels_in, logits);
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor logp = at::empty(labels.sizes(), opts);
  at::Tensor lse = at::empty(labels.sizes(), opts);
  at::Tensor entropy = at::empty(labels.sizes(), opts);
  std::optional<at::Tensor> valid_c;
  if (valid.has_value()) valid_c = checked_valid(*valid, labels, logits);
  const auto temps_c = per_token(row_temps, labels, logits, "row_temps");
  check_launch(launch_logprobs_forward(
                   logits.data_ptr(), dtype_of(logits.scalar_type(), "logits"), layout,
                   labels.data_ptr<int64_t>(),
                   valid_c.has_value() ? valid_c->data_ptr<int8_t>() : nullptr,
                   row_read(temperature, temps_c, cap), logp.data_ptr<float>(),
                   lse.data_ptr<float>(), entropy.data_ptr<float>(), stream_of(logits)),
               "logprobs_forward");
  return {logp, lse, entropy};
}

void logits_grad(const at::Tensor& logits, const at::Tensor& labels_in, const at::Tensor& lse,
                 const at::Tensor& entropy, const at::Tensor& dlogp,
                 const std::optional<at::Tensor>& dentropy, double temperature, at::Tensor out,
                 const std::optional<at::Tensor>& row_temps, std::optional<double> cap) {
  const RowLayout layout = layout_of(logits, "logits");
  const c10::cuda::CUDAGuard device_guard(logits.device());
  check_device(out, logits, "out");
  const RowLayout out_layout = layout_of(out, "out");
  TORCH_CHECK(out.sizes() == logits.sizes() && out.scalar_type() == logits.scalar_type(),
              "fusedrl: out must match logits in shape and dtype");
  const at::Tensor labels = checked_labels(labels_in, logits);
  const at::Tensor lse_c = per_token(lse, labels, logits, "lse");
  const at::Tensor entropy_c = per_token(entropy, labels, logits, "entropy");
  const at::Tensor dlogp_c = per_token(dlogp, labels, logits, "dlogp");
  const auto dentropy_c = per_token(dentropy, labels, logits, "dentropy");
  const auto temps_c = per_token(row_temps, labels, logits, "row_temps");
  check_launch(launch_logits_grad(logits.data_ptr(), out.data_ptr(),
                                  dtype_of(logits.scalar_type(), "logits"), layout, out_layout,
                                  labels.data_ptr<int64_t>(), lse_c.data_ptr<float>(),
                                  entropy_c.data_ptr<float>(), dlogp_c.data_ptr<float>(),
                                  data_or_null(dentropy_c), row_read(temperature, temps_c, cap),
                                  stream_of(logits)),
               "logits_grad");
}

std::tuple<at::Tensor, at::Tensor> fused_token_loss(
    const at::Tensor& logits, at::Tensor grad, const at::Tensor& labels_in,
    const at::Tensor& valid, const at::Tensor& advantages,
    const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
    const std::optional<at::Tensor>& is_weight, const at::Tensor& agg_weight,
    const std::optional<at::Tensor>& low, const std::optional<at::Tensor>& high,
    double temperature, const std::string& loss, std::optional<double> dual_clip_c,
    std::optional<double> delta, double tau_pos, double tau_neg,
    const std::optional<std::string>& kl, double beta, double entropy_coef,
    const std::optional<at::Tensor>& row_temps, std::optional<double> cap,
    const std::optional<at::Tensor>& entropy_coef_tensor) {
  const RowLayout layout = layout_of(logits, "logits");
  const c10::cuda::CUDAGuard device_guard(logits.device());
  check_device(grad, logits, "grad");
  const RowLayout grad_layout = layout_of(grad, "grad");
  TORCH_CHECK(grad.sizes() == logits.sizes() && grad.scalar_type() == logits.scalar_type(),
              "fusedrl: grad must match logits in shape and dtype");
  const at::Tensor labels = checked_labels(labels_in, logits);
  const at::Tensor valid_c = checked_valid(valid, labels, logits);
  const at::Tensor adv_c = per_token(advantages, labels, logits, "advantages");
  const auto old_c = per_token(old_logp, labels, logits, "old_logp");
  const auto ref_c = per_token(ref_logp, labels, logits, "ref_logp");
  const auto is_c = per_token(is_weight, labels, logits, "is_weight");
  const at::Tensor agg_c = per_token(agg_weight, labels, logits, "agg_weight");
  const auto low_c = per_token(low, labels, logits, "low");
  const auto high_c = per_token(high, labels, logits, "high");
  const auto temps_c = per_token(row_temps, labels, logits, "row_temps");
  std::optional<at::Tensor> coef_c;
  if (entropy_coef_tensor.has_value()) {
    check_device(*entropy_coef_tensor, logits, "entropy_coef_tensor");
    TORCH_CHECK(entropy_coef_tensor->numel() == 1,
                "fusedrl: entropy_coef_tensor must hold one value, got shape ",
                dims(entropy_coef_tensor->sizes()));
    coef_c = entropy_coef_tensor->to(at::kFloat).contiguous();
  }
  const int kl_kind = kl_code(kl, beta);
  TORCH_CHECK(kl_kind == 0 || ref_c.has_value(), "fusedrl: ref_logp is required when beta > 0");
  const TokenLossParams params{loss_code(loss),
                               dual_clip_c.has_value(),
                               static_cast<float>(dual_clip_c.value_or(0.0)),
                               delta.has_value(),
                               static_cast<float>(delta.value_or(0.0)),
                               static_cast<float>(tau_pos),
                               static_cast<float>(tau_neg),
                               kl_kind,
                               static_cast<float>(beta),
                               static_cast<float>(entropy_coef),
                               row_read(temperature, temps_c, cap)};
  const TokenLossInputs inputs{labels.data_ptr<int64_t>(), valid_c.data_ptr<int8_t>(),
                               adv_c.data_ptr<float>(),    data_or_null(old_c),
                               data_or_null(ref_c),        data_or_null(is_c),
                               agg_c.data_ptr<float>(),    data_or_null(low_c),
                               data_or_null(high_c),       data_or_null(coef_c)};
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor logp = at::empty(labels.sizes(), opts);
  at::Tensor entropy = at::empty(labels.sizes(), opts);
  check_launch(launch_fused_token_loss(logits.data_ptr(), grad.data_ptr(),
                                       dtype_of(logits.scalar_type(), "logits"), layout,
                                       grad_layout, inputs, params, logp.data_ptr<float>(),
                                       entropy.data_ptr<float>(), stream_of(logits)),
               "fused_token_loss");
  return {logp, entropy};
}

std::tuple<at::Tensor, at::Tensor> fused_token_loss_inplace(
    at::Tensor logits, const at::Tensor& labels, const at::Tensor& valid,
    const at::Tensor& advantages, const std::optional<at::Tensor>& old_logp,
    const std::optional<at::Tensor>& ref_logp, const std::optional<at::Tensor>& is_weight,
    const at::Tensor& agg_weight, const std::optional<at::Tensor>& low,
    const std::optional<at::Tensor>& high, double temperature, const std::string& loss,
    std::optional<double> dual_clip_c, std::optional<double> delta, double tau_pos,
    double tau_neg, const std::optional<std::string>& kl, double beta, double entropy_coef,
    const std::optional<at::Tensor>& row_temps, std::optional<double> cap,
    const std::optional<at::Tensor>& entropy_coef_tensor) {
  return fused_token_loss(logits, logits, labels, valid, advantages, old_logp, ref_logp,
                          is_weight, agg_weight, low, high, temperature, loss, dual_clip_c, delta,
                          tau_pos, tau_neg, kl, beta, entropy_coef, row_temps, cap,
                          entropy_coef_tensor);
}

// [available, ptx_version, binary_version, max_dynamic_smem, attribute_sets] of the one-read
// cluster kernel for `dtype` on `device` (fused_loss.h, ClusterKernelInfo): which of the two
// fused kernels the loaded code lets launch_fused_token_loss choose there.
std::vector<int64_t> cluster_kernel_info(c10::Device device, c10::ScalarType dtype) {
  TORCH_CHECK(device.is_cuda(), "fusedrl: device must be a CUDA device, got ", device);
  const c10::cuda::CUDAGuard device_guard(device);
  ClusterKernelInfo info{};
  check_launch(query_cluster_kernel(dtype_of(dtype, "dtype"), &info),
               "query_cluster_kernel");
  return {info.available ? 1 : 0, info.ptx_version, info.binary_version, info.max_dynamic_smem,
          info.attribute_sets};
}

}  // namespace
}  // namespace fusedrl

// The per-token arguments of the fused loss: the fields of kernels/token_args.py's TokenLossArgs
// that its CUDA_FIELDS names, by the same names and types (tests/test_cuda_build.py checks it),
// so that both backends share one driver (kernels/cuda.py's `by_name` passes them by name).
#define FUSEDRL_FUSED_ARGS                                                                   \
  "Tensor labels, Tensor valid, Tensor advantages, Tensor? old_logp, Tensor? ref_logp, "   \
  "Tensor? is_weight, Tensor agg_weight, Tensor? low, Tensor? high, float temperature, "   \
  "str loss, float? dual_clip_c, float? delta, float tau_pos, float tau_neg, str? kl, "    \
  "float beta, float entropy_coef"

// The keywords of the Triton ops by which every row op reads per-token temperatures and a soft
// cap (fusedrl.fused_backend.temperature_keywords).
#define FUSEDRL_ROW_READ "Tensor? row_temps=None, float? cap=None"
// ... and the fused ops' entropy coefficient as a device scalar (read by the kernel: no sync).
#define FUSEDRL_ENTROPY_COEF "Tensor? entropy_coef_tensor=None"

TORCH_LIBRARY(fusedrl, m) {
  m.def(
      "cuda_logprobs_fwd(Tensor logits, Tensor labels, Tensor? valid, float temperature, "
      "*, " FUSEDRL_ROW_READ ") -> (Tensor, Tensor, Tensor)");
  m.def(
      "cuda_logits_grad(Tensor logits, Tensor labels, Tensor lse, Tensor entropy, "
      "Tensor dlogp, Tensor? dentropy, float temperature, Tensor(a!) out, *, " FUSEDRL_ROW_READ
      ") -> ()");
  m.def("cuda_fused_token_loss(Tensor logits, Tensor(a!) grad, " FUSEDRL_FUSED_ARGS
        ", *, " FUSEDRL_ROW_READ ", " FUSEDRL_ENTROPY_COEF ") -> (Tensor, Tensor)");
  m.def("cuda_fused_token_loss_inplace(Tensor(a!) logits, " FUSEDRL_FUSED_ARGS
        ", *, " FUSEDRL_ROW_READ ", " FUSEDRL_ENTROPY_COEF ") -> (Tensor, Tensor)");
  // No tensor argument, so no dispatch key: one kernel for every backend.
  m.def("cuda_cluster_kernel_info(Device device, ScalarType dtype) -> int[]",
        &fusedrl::cluster_kernel_info);
}

TORCH_LIBRARY_IMPL(fusedrl, CUDA, m) {
  m.impl("cuda_logprobs_fwd", &fusedrl::logprobs_fwd);
  m.impl("cuda_logits_grad", &fusedrl::logits_grad);
  m.impl("cuda_fused_token_loss", &fusedrl::fused_token_loss);
  m.impl("cuda_fused_token_loss_inplace", &fusedrl::fused_token_loss_inplace);
}

// Importable as fusedrl._C when built by setup.py (the ops above register on import). The JIT
// build (fusedrl/kernels/cuda.py) loads the library without importing it.
#define FUSEDRL_CONCAT_(a, b) a##b
#define FUSEDRL_CONCAT(a, b) FUSEDRL_CONCAT_(a, b)
#define FUSEDRL_STRING_(a) #a
#define FUSEDRL_STRING(a) FUSEDRL_STRING_(a)

PyMODINIT_FUNC FUSEDRL_CONCAT(PyInit_, TORCH_EXTENSION_NAME)() {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, FUSEDRL_STRING(TORCH_EXTENSION_NAME),
      "fusedrl CUDA kernels; the ops live in torch.ops.fusedrl.cuda_*", -1,
      nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
