// fusedrl CUDA kernels: the launcher interface between fused_loss.cu (pure CUDA, no torch headers,
// so that every .cu compiles to object code on a machine without a GPU) and bindings.cpp (torch ops).
//
// Semantics are those of fusedrl/token_terms.py and the Triton kernels in kernels/: one thread
// block per row (token) of [B, T, V] logits with arbitrary batch/time strides and a contiguous
// vocab axis; fp32 accumulation; masked rows (valid == 0) are never read and get zero gradient.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace fusedrl {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// [B, T, V] logits (or a gradient buffer) addressed by flat row = b * T + t.
struct RowLayout {
  int64_t rows;      // B * T
  int64_t time;      // T
  int64_t vocab;     // V
  int64_t stride_b;  // elements
  int64_t stride_t;  // elements
};

// How the kernels read a row's logits x: as z = v / T with v = x, or, under a soft cap
// (y = c tanh(s x / c), passed as cap = s / c and the temperature T / c), v = tanh(cap x).
// `temperatures`: per-row T ([rows] fp32), or nullptr for 1 / inv_temperature.
struct RowRead {
  float inv_temperature;
  const float* temperatures;
  float cap;  // 0: no cap
};

// Token-level variant of the policy loss, as constants of one launch.
// The variants' codes (kernels/token_loss.py's LOSS_CODES / KL_CODES have the same values).
enum LossCode : int { kLossClipped = 0, kLossCispo = 1, kLossSapo = 2, kLossPg = 3 };
enum KlCode : int {
  kKlNone = 0,
  kKlK1 = 1,
  kKlK2 = 2,
  kKlAbs = 3,
  kKlK3 = 4,
  kKlStraightThrough = 5,  // k1+ / k3+: the value of k1 / k3, the gradient of k2
};

struct TokenLossParams {
  int loss;            // a LossCode: ppo/dcpo (per-token bounds), cispo, sapo, pg
  bool dual_clip;
  float dual_clip_c;
  bool has_delta;
  float delta;
  float tau_pos;
  float tau_neg;
  int kl;              // a KlCode
  float beta;
  float entropy_coef;
  RowRead read;
};

// Per-token inputs of the fused loss ([B, T] contiguous fp32 unless noted; nullptr = absent).
struct TokenLossInputs {
  const int64_t* labels;
  const int8_t* valid;
  const float* advantages;
  const float* old_logp;     // nullptr: on-policy (old = logp)
  const float* ref_logp;     // used when params.kl != kKlNone
  const float* is_weight;    // nullptr: no IS correction
  const float* agg_weight;
  const float* low;          // ratio bounds (ppo/dcpo/cispo)
  const float* high;
  // The entropy coefficient as one device float (adaptive entropy control moves it between
  // steps without a host sync); nullptr: params.entropy_coef.
  const float* entropy_coef;
};

// logp, lse, entropy of each row (fp32 [rows]); `valid` may be nullptr.
cudaError_t launch_logprobs_forward(const void* logits, DType dtype, RowLayout layout,
                                    const int64_t* labels, const int8_t* valid, RowRead read,
                                    float* logp, float* lse, float* entropy, cudaStream_t stream);

// out = d loss / d logits from per-row dlogp (and dentropy, may be nullptr); out may be logits.
cudaError_t launch_logits_grad(const void* logits, void* out, DType dtype, RowLayout layout,
                               RowLayout out_layout, const int64_t* labels, const float* lse,
                               const float* entropy, const float* dlogp, const float* dentropy,
                               RowRead read, cudaStream_t stream);

// The fused token-level loss: logp, entropy per row, and the gradient written into `grad`
// (which may be `logits`).
cudaError_t launch_fused_token_loss(const void* logits, void* grad, DType dtype, RowLayout layout,
                                    RowLayout grad_layout, TokenLossInputs inputs,
                                    TokenLossParams params, float* logp, float* entropy,
                                    cudaStream_t stream);

// How launch_fused_token_loss chooses between its two kernels on the current device for `dtype`
// (see cluster_state in fused_loss.cu): `available` when the loaded code of the one-read cluster
// kernel was compiled for compute_90+ (ptx_version, binary_version: cudaFuncAttributes of that
// code) and the device launches clusters; it then runs for rows whose slices fit
// max_dynamic_smem bytes, unless FUSEDRL_CUDA_ONE_READ=0. attribute_sets counts the
// cudaFuncSetAttribute calls made for it on this device (one at most: set once, at the maximum).
struct ClusterKernelInfo {
  bool available;
  int ptx_version;
  int binary_version;
  int max_dynamic_smem;
  int attribute_sets;
};

cudaError_t query_cluster_kernel(DType dtype, ClusterKernelInfo* info);

}  // namespace fusedrl
