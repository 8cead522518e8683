// fusedrl CUDA kernels: token log-probs, the gradient sweep, and the fused token-level policy loss.
//
// One thread block per row (token), grid-stride over rows (any number of rows). Each row is read
// with 16-byte vector loads after peeling the unaligned head (a [B, P+T, V] slice with odd V is
// not 16-byte aligned per row), statistics are accumulated in fp32 per thread (online max, sum of
// exp, sum of exp * z for the entropy) and combined with warp shuffles + shared memory. The
// per-row scalars (ratio, clip, KL, IS and aggregation weights) are evaluated by one thread and
// broadcast; the gradient sweep then walks the row from its last vector backwards, so that the
// part most recently streamed by the statistics sweep (most likely still in L2) is re-read first.
//
// The formulas are those of fusedrl/token_terms.py (and kernels/token_loss.py), clamps and
// tie rules included.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "fused_loss.h"

namespace fusedrl {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr float kInf = __builtin_huge_valf();
constexpr float kLogRatioClamp = 20.f;
constexpr float kKlLogClamp = 20.f;
constexpr float kKlValueClamp = 10.f;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// 16 bytes of T: the unit of every global load / store of the sweeps.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

__device__ __forceinline__ int64_t row_offset(int64_t row, const RowLayout& layout) {
  return (row / layout.time) * layout.stride_b + (row % layout.time) * layout.stride_t;
}

// Elements before the first 16-byte boundary of a row (0 when the row starts aligned).
template <typename T>
__device__ __forceinline__ int64_t unaligned_head(const void* ptr, int64_t vocab) {
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  const int64_t head = static_cast<int64_t>((16 - addr % 16) % 16) / sizeof(T);
  return head < vocab ? head : vocab;
}

// ------------------------------------------------------------------------------ statistics
// Online softmax state of z = logits / temperature: max m, sum exp(z - m), sum exp(z - m) z.
struct Stats {
  float m = -kInf;
  float s = 0.f;
  float t = 0.f;
};

// While the max is still -inf (a prefix of banned tokens) it is taken as 0 so that
// exp(-inf - max) = 0 instead of NaN. A +inf logit makes s NaN (exp(inf - inf)), which the
// callers surface as a NaN logp, as the reference does.
__device__ __forceinline__ float safe_max(float m) { return m == -kInf ? 0.f : m; }

__device__ __forceinline__ void rescale_to(Stats& st, float new_m) {
  const float scale = st.s == 0.f ? 0.f : expf(st.m - safe_max(new_m));
  st.s *= scale;
  st.t *= scale;
  st.m = new_m;
}

__device__ __forceinline__ void accumulate(Stats& st, float z) {
  const float e = expf(z - safe_max(st.m));
  st.s += e;
  st.t += e > 0.f ? e * z : 0.f;  // -inf logits: p = 0 contributes 0, not 0 * -inf
}

__device__ __forceinline__ Stats merge(const Stats& a, const Stats& b) {
  Stats out;
  out.m = fmaxf(a.m, b.m);
  const float ref = safe_max(out.m);
  const float sa = a.s == 0.f ? 0.f : expf(a.m - ref);
  const float sb = b.s == 0.f ? 0.f : expf(b.m - ref);
  out.s = a.s * sa + b.s * sb;
  out.t = a.t * sa + b.t * sb;
  return out;
}

// Block-wide merge; every thread gets the result.
__device__ Stats block_reduce(Stats st) {
  __shared__ float sm[kWarps], ss[kWarps], stt[kWarps];
  __shared__ Stats total;
  for (int offset = 16; offset > 0; offset >>= 1) {
    Stats other;
    other.m = __shfl_xor_sync(0xffffffffu, st.m, offset);
    other.s = __shfl_xor_sync(0xffffffffu, st.s, offset);
    other.t = __shfl_xor_sync(0xffffffffu, st.t, offset);
    st = merge(st, other);
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
    sm[warp] = st.m;
    ss[warp] = st.s;
    stt[warp] = st.t;
  }
  __syncthreads();
  if (warp == 0) {
    Stats w;
    if (lane < kWarps) {
      w.m = sm[lane];
      w.s = ss[lane];
      w.t = stt[lane];
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      Stats other;
      other.m = __shfl_xor_sync(0xffffffffu, w.m, offset);
      other.s = __shfl_xor_sync(0xffffffffu, w.s, offset);
      other.t = __shfl_xor_sync(0xffffffffu, w.t, offset);
      w = merge(w, other);
    }
    if (lane == 0) total = w;
  }
  __syncthreads();
  const Stats result = total;
  __syncthreads();  // `total` is reused by the next row of the grid-stride loop
  return result;
}

// One read of the row: per-thread online statistics over 16-byte packs, then a block merge.
template <typename T>
__device__ Stats row_stats(const T* row, int64_t vocab, float inv_temperature) {
  Stats st;
  const int64_t head = unaligned_head<T>(row, vocab);
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) {
    const float z = to_float(row[j]) * inv_temperature;
    if (z > st.m) rescale_to(st, z);
    accumulate(st, z);
  }
  constexpr int kPack = Pack<T>::kSize;
  const int64_t packs = (vocab - head) / kPack;
  const auto* packed = reinterpret_cast<const Pack<T>*>(row + head);
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T> p = packed[i];
    float z[kPack];
    float pack_max = -kInf;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      z[k] = to_float(p.v[k]) * inv_temperature;
      pack_max = fmaxf(pack_max, z[k]);
    }
    if (pack_max > st.m) rescale_to(st, pack_max);
#pragma unroll
    for (int k = 0; k < kPack; ++k) accumulate(st, z[k]);
  }
  for (int64_t j = head + packs * kPack + threadIdx.x; j < vocab; j += blockDim.x) {
    const float z = to_float(row[j]) * inv_temperature;
    if (z > st.m) rescale_to(st, z);
    accumulate(st, z);
  }
  return block_reduce(st);
}

// ------------------------------------------------------------------------------ gradient sweep
struct RowGrad {
  int64_t label;
  float lse;
  float entropy;
  float dlogp;
  float dentropy;
  float inv_temperature;

  __device__ __forceinline__ float operator()(int64_t j, float raw) const {
    const float log_p = raw * inv_temperature - lse;
    const float p = expf(log_p);
    float g = (j == label ? dlogp : 0.f) - dlogp * p;
    if (dentropy != 0.f && p > 0.f) g -= dentropy * p * (log_p + entropy);
    return g * inv_temperature;
  }
};

template <typename T>
__device__ void write_row_grad(const T* row, T* out, int64_t vocab, const RowGrad& f) {
  const int64_t head = unaligned_head<T>(row, vocab);
  if (head != unaligned_head<T>(out, vocab)) {  // input and output disagree on alignment
    for (int64_t j = vocab - 1 - threadIdx.x; j >= 0; j -= blockDim.x) {
      out[j] = from_float<T>(f(j, to_float(row[j])));
    }
    return;
  }
  constexpr int kPack = Pack<T>::kSize;
  const int64_t packs = (vocab - head) / kPack;
  for (int64_t j = head + packs * kPack + threadIdx.x; j < vocab; j += blockDim.x) {
    out[j] = from_float<T>(f(j, to_float(row[j])));
  }
  const auto* packed_in = reinterpret_cast<const Pack<T>*>(row + head);
  auto* packed_out = reinterpret_cast<Pack<T>*>(out + head);
  for (int64_t i = packs - 1 - threadIdx.x; i >= 0; i -= blockDim.x) {
    const Pack<T> p = packed_in[i];
    Pack<T> g;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      g.v[k] = from_float<T>(f(head + i * kPack + k, to_float(p.v[k])));
    }
    packed_out[i] = g;
  }
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) {
    out[j] = from_float<T>(f(j, to_float(row[j])));
  }
}

template <typename T>
__device__ void write_row_zeros(T* out, int64_t vocab) {
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) out[j] = from_float<T>(0.f);
}

// ------------------------------------------------------------------------------ token scalars
__device__ __forceinline__ float clampf(float x, float lo, float hi) {
  return fminf(fmaxf(x, lo), hi);
}

// d max(a, b): the larger branch's derivative, half of each at a tie (torch.maximum).
__device__ __forceinline__ float select_max_grad(float a, float b, float da, float db) {
  return a > b ? da : (b > a ? db : 0.5f * (da + db));
}

__device__ float policy_dlogp(float logp, float old, float adv, float low, float high,
                              const TokenLossParams& p) {
  const float raw_log_ratio = logp - old;
  const float ratio = expf(clampf(raw_log_ratio, -kLogRatioClamp, kLogRatioClamp));
  const bool inside_clamp = raw_log_ratio >= -kLogRatioClamp && raw_log_ratio <= kLogRatioClamp;
  const float dratio = inside_clamp ? ratio : 0.f;
  const float clipped = fminf(fmaxf(ratio, low), high);
  if (p.loss == 1) return -clipped * adv;  // cispo
  if (p.loss == 2) {                       // sapo
    const float tau = adv > 0.f ? p.tau_pos : p.tau_neg;
    const float gate = 1.f / (1.f + expf(-tau * (ratio - 1.f)));
    return -4.f * gate * (1.f - gate) * dratio * adv;
  }
  if (p.loss == 3) return -adv;  // pg
  float loss_unclipped, d_unclipped;
  if (p.has_delta) {
    loss_unclipped = -adv * fminf(ratio, p.delta);
    d_unclipped = ratio <= p.delta ? -adv * dratio : 0.f;
  } else {
    loss_unclipped = -adv * ratio;
    d_unclipped = -adv * dratio;
  }
  const float loss_clipped = -adv * clipped;
  const float d_clipped = (ratio >= low && ratio <= high) ? -adv * dratio : 0.f;
  float d = select_max_grad(loss_unclipped, loss_clipped, d_unclipped, d_clipped);
  if (p.dual_clip && adv < 0.f) {
    const float per_token = fmaxf(loss_unclipped, loss_clipped);
    const float loss_dual = -adv * p.dual_clip_c;
    d *= per_token < loss_dual ? 1.f : (per_token > loss_dual ? 0.f : 0.5f);
  }
  return d;
}

__device__ float kl_dlogp(float logp, float ref, int kind) {
  const float delta = logp - ref;
  switch (kind) {
    case 1:
      return 1.f;
    case 2:
    case 5:
      return delta;
    case 3:
      return delta > 0.f ? 1.f : (delta < 0.f ? -1.f : 0.f);
    case 4: {
      const float log_ratio = clampf(-delta, -kKlLogClamp, kKlLogClamp);
      const float raw = expf(log_ratio) - log_ratio - 1.f;
      const bool inside = delta >= -kKlLogClamp && delta <= kKlLogClamp &&
                          raw >= -kKlValueClamp && raw <= kKlValueClamp;
      return inside ? 1.f - expf(log_ratio) : 0.f;
    }
    default:
      return 0.f;
  }
}

// ------------------------------------------------------------------------------ kernels
template <typename T>
__global__ void __launch_bounds__(kThreads)
    logprobs_forward_kernel(const T* logits, RowLayout layout, const int64_t* labels,
                            const int8_t* valid, float inv_temperature, float* logp, float* lse,
                            float* entropy) {
  for (int64_t row = blockIdx.x; row < layout.rows; row += gridDim.x) {
    if (valid != nullptr && valid[row] == 0) {
      if (threadIdx.x == 0) logp[row] = lse[row] = entropy[row] = 0.f;
      continue;
    }
    const T* row_ptr = logits + row_offset(row, layout);
    const Stats st = row_stats(row_ptr, layout.vocab, inv_temperature);
    if (threadIdx.x == 0) {
      const float row_lse = st.m == kInf ? __int_as_float(0x7fc00000) : st.m + logf(st.s);
      logp[row] = to_float(row_ptr[labels[row]]) * inv_temperature - row_lse;
      lse[row] = row_lse;
      entropy[row] = row_lse - st.t / st.s;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    logits_grad_kernel(const T* logits, T* out, RowLayout layout, RowLayout out_layout,
                       const int64_t* labels, const float* lse, const float* entropy,
                       const float* dlogp, const float* dentropy, float inv_temperature) {
  for (int64_t row = blockIdx.x; row < layout.rows; row += gridDim.x) {
    T* out_row = out + row_offset(row, out_layout);
    const RowGrad f{labels[row], lse[row], entropy[row], dlogp[row],
                    dentropy != nullptr ? dentropy[row] : 0.f, inv_temperature};
    if (f.dlogp == 0.f && f.dentropy == 0.f) {
      write_row_zeros(out_row, layout.vocab);
    } else {
      write_row_grad(logits + row_offset(row, layout), out_row, layout.vocab, f);
    }
    __syncthreads();  // in place: the next row's reads never overlap, but keep blocks in step
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    fused_token_loss_kernel(const T* logits, T* grad, RowLayout layout, RowLayout grad_layout,
                            TokenLossInputs in, TokenLossParams params, float* logp_out,
                            float* entropy_out) {
  __shared__ RowGrad shared_grad;
  for (int64_t row = blockIdx.x; row < layout.rows; row += gridDim.x) {
    T* grad_row = grad + row_offset(row, grad_layout);
    if (in.valid[row] == 0) {
      write_row_zeros(grad_row, layout.vocab);
      if (threadIdx.x == 0) logp_out[row] = entropy_out[row] = 0.f;
      continue;
    }
    const T* row_ptr = logits + row_offset(row, layout);
    const Stats st = row_stats(row_ptr, layout.vocab, params.inv_temperature);
    if (threadIdx.x == 0) {
      const float lse = st.m == kInf ? __int_as_float(0x7fc00000) : st.m + logf(st.s);
      const float entropy = lse - st.t / st.s;
      const int64_t label = in.labels[row];
      const float logp = to_float(row_ptr[label]) * params.inv_temperature - lse;
      const float old = in.old_logp != nullptr ? in.old_logp[row] : logp;
      const float low = in.low != nullptr ? in.low[row] : 0.f;
      const float high = in.high != nullptr ? in.high[row] : 0.f;
      float d = policy_dlogp(logp, old, in.advantages[row], low, high, params);
      if (in.is_weight != nullptr) d *= in.is_weight[row];
      if (params.kl != 0) d += params.beta * kl_dlogp(logp, in.ref_logp[row], params.kl);
      const float agg = in.agg_weight[row];
      shared_grad = RowGrad{label, lse, entropy, d * agg, -params.entropy_coef * agg,
                            params.inv_temperature};
      logp_out[row] = logp;
      entropy_out[row] = entropy;
    }
    __syncthreads();
    const RowGrad f = shared_grad;
    write_row_grad(row_ptr, grad_row, layout.vocab, f);
    __syncthreads();  // shared_grad is rewritten by the next row
  }
}

int grid_for(int64_t rows) {
  // Enough blocks to fill any current GPU many times over; the kernels grid-stride beyond.
  constexpr int64_t kMaxBlocks = 1 << 20;
  return static_cast<int>(rows < kMaxBlocks ? (rows > 0 ? rows : 1) : kMaxBlocks);
}

template <typename Fn>
cudaError_t dispatch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(float{});
    case DType::kFloat16:
      return fn(__half{});
    case DType::kBFloat16:
      return fn(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_logprobs_forward(const void* logits, DType dtype, RowLayout layout,
                                    const int64_t* labels, const int8_t* valid,
                                    float inv_temperature, float* logp, float* lse, float* entropy,
                                    cudaStream_t stream) {
  if (layout.rows == 0) return cudaSuccess;
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    logprobs_forward_kernel<T><<<grid_for(layout.rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), layout, labels, valid, inv_temperature, logp, lse, entropy);
    return cudaGetLastError();
  });
}

cudaError_t launch_logits_grad(const void* logits, void* out, DType dtype, RowLayout layout,
                               RowLayout out_layout, const int64_t* labels, const float* lse,
                               const float* entropy, const float* dlogp, const float* dentropy,
                               float inv_temperature, cudaStream_t stream) {
  if (layout.rows == 0) return cudaSuccess;
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    logits_grad_kernel<T><<<grid_for(layout.rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), static_cast<T*>(out), layout, out_layout, labels, lse,
        entropy, dlogp, dentropy, inv_temperature);
    return cudaGetLastError();
  });
}

cudaError_t launch_fused_token_loss(const void* logits, void* grad, DType dtype, RowLayout layout,
                                    RowLayout grad_layout, TokenLossInputs inputs,
                                    TokenLossParams params, float* logp, float* entropy,
                                    cudaStream_t stream) {
  if (layout.rows == 0) return cudaSuccess;
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    fused_token_loss_kernel<T><<<grid_for(layout.rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), static_cast<T*>(grad), layout, grad_layout, inputs, params,
        logp, entropy);
    return cudaGetLastError();
  });
}

}  // namespace fusedrl
