// fusedrl CUDA kernels: token log-probs, the gradient sweep, and the fused token-level policy loss.
//
// One thread block per row (token), grid-stride over rows; the fused kernel's grid is sized so that
// the rows in flight fit L2 (its second sweep re-reads the row). Each row is read with 16-byte
// vector loads after peeling the unaligned head (a [B, P+T, V] slice with odd V is not 16-byte
// aligned per row); in-row indices are 32-bit.
//
// Sweep 1 works in base 2 (y = logit * log2(e) / T, one FFMA with the pre-scaled factor) and sums
// 2^(y - y_label) and 2^(y - y_label) (y - y_label) relative to the label logit, not to a running
// max: one ex2.approx per element, no compare, no rescale. The label's own term is 1, so the sums
// overflow only when a logit exceeds the label's by more than ~110 (base 2), or on NaN / inf; such
// a row is read again by the exact online softmax. The per-row scalars (ratio, clip, KL, IS and
// aggregation weights) are evaluated by one thread and broadcast; the gradient sweep then walks
// the row from its last vector backwards (the part sweep 1 streamed last is the likeliest still in
// L2), writes p (k0 + k1 log2 p) (the entropy term a template flag), and thread 0 writes the
// label's one-hot term after the sweep, so the loop has no compare with the label.
//
// The formulas are those of fusedrl/token_terms.py (and kernels/token_loss.py), clamps and
// tie rules included.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "fused_loss.h"

namespace fusedrl {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// Two blocks per SM at most (64 registers): the fused kernel's grid keeps rows in flight <= L2.
constexpr int kMinBlocksPerSm = 2;
constexpr float kInf = __builtin_huge_valf();
constexpr float kLogRatioClamp = 20.f;
constexpr float kKlLogClamp = 20.f;
constexpr float kKlValueClamp = 10.f;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// 2^(kFloor - max) is 0 for any real row: logits below it (-inf: banned tokens) count as p = 0
// without a select, and kFloor x (dentropy ln2 / T) stays finite.
constexpr float kFloor = -1e20f;

// The row functions of the two-sweep kernels are also built for the host, where
// tests/cuda_host_kernels.cu runs them on the CPU as blocks of one thread (the kernels' own code,
// checked against the oracle without a GPU): there the thread's rank is 0, the block has one
// thread, the barrier and the block reductions are no-ops, and the approximate instructions are
// their exact libm counterparts. On the device these are the built-ins themselves.
#define FUSEDRL_HD __host__ __device__

FUSEDRL_HD __forceinline__ unsigned thread_rank() {
#ifdef __CUDA_ARCH__
  return threadIdx.x;
#else
  return 0;
#endif
}

FUSEDRL_HD __forceinline__ unsigned block_threads() {
#ifdef __CUDA_ARCH__
  return blockDim.x;
#else
  return 1;
#endif
}

FUSEDRL_HD __forceinline__ void block_sync() {
#ifdef __CUDA_ARCH__
  __syncthreads();
#endif
}

FUSEDRL_HD __forceinline__ float float_from_bits(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

// One MUFU.EX2 (denormal results flush to 0: nothing a softmax can see).
FUSEDRL_HD __forceinline__ float ex2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  const float y = exp2f(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
#endif
}

// max that keeps a NaN operand (fmaxf would drop it and hide a NaN logit): sm_80+.
FUSEDRL_HD __forceinline__ float max_nan(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a || b != b ? float_from_bits(0x7fffffffu) : fmaxf(a, b);
#endif
}

// One MUFU.RCP.
FUSEDRL_HD __forceinline__ float rcp(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.f / x;
#endif
}

// a / b with the device's approximate division (2 ulp; an IEEE division is a subroutine call).
FUSEDRL_HD __forceinline__ float fast_divide(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdividef(a, b);
#else
  return a / b;
#endif
}

template <typename T>
FUSEDRL_HD __forceinline__ float to_float(T x);
template <>
FUSEDRL_HD __forceinline__ float to_float<float>(float x) { return x; }
template <>
FUSEDRL_HD __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
FUSEDRL_HD __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
FUSEDRL_HD __forceinline__ T from_float(float x);
template <>
FUSEDRL_HD __forceinline__ float from_float<float>(float x) { return x; }
template <>
FUSEDRL_HD __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
FUSEDRL_HD __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The most negative finite T, as a float: masks write it (or -inf) for banned tokens.
template <typename T>
FUSEDRL_HD __forceinline__ float lowest();
template <>
FUSEDRL_HD __forceinline__ float lowest<float>() { return float_from_bits(0xff7fffffu); }
template <>
FUSEDRL_HD __forceinline__ float lowest<__half>() { return -65504.f; }
template <>
FUSEDRL_HD __forceinline__ float lowest<__nv_bfloat16>() { return float_from_bits(0xff7f0000u); }

// A soft-capped logit x (fused_loss.h, RowRead): (v, d v / d x / (4 cap)) with v = tanh(cap x) =
// 1 - 2 r, r = 1 / (1 + 2^(x cap2)), cap2 = 2 cap log2(e): one ex2 and one rcp (the formula of
// kernels/rows.py `capped`), and d v / d x = 4 cap r (1 - r). A banned logit (at or below T's
// lowest) stays -inf instead of becoming -1 (-c after the cap's scale).
template <typename T>
FUSEDRL_HD __forceinline__ float2 capped(float x, float cap2) {
  const float r = rcp(1.f + ex2(x * cap2));
  return make_float2(x <= lowest<T>() ? -kInf : fmaf(-2.f, r, 1.f), fmaf(-r, r, r));
}

// How one row's logits are read: z = v * inv_temperature, v = x or, with kCap, tanh(cap x).
template <typename T, bool kCap>
struct Reader {
  float inv_temperature;  // the row's (per-token temperatures: 1 / temperatures[row])
  float cap2;             // 2 cap log2(e)

  FUSEDRL_HD static Reader make(const RowRead& read, int64_t row) {
    // rcp.approx-based (2 ulp), as Triton divides: an IEEE division is a subroutine call, whose
    // saved registers spilled in the capped cluster kernel.
    const float inv_temperature = read.temperatures != nullptr
                                      ? fast_divide(1.f, read.temperatures[row])
                                      : read.inv_temperature;
    return Reader{inv_temperature, 2.f * kLog2e * read.cap};
  }

  FUSEDRL_HD __forceinline__ float value(float x) const {
    return kCap ? capped<T>(x, cap2).x : x;
  }
};

// 16 bytes of T: the unit of every global load / store of the sweeps.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

FUSEDRL_HD __forceinline__ int64_t row_offset(int64_t row, const RowLayout& layout) {
  // A 32-bit division where the row and T fit (any real batch): inline, where a 64-bit one is
  // a subroutine call whose saved registers went to the stack in the capped cluster kernel.
  if (row <= INT32_MAX && layout.time <= INT32_MAX) {
    const auto r = static_cast<uint32_t>(row), time = static_cast<uint32_t>(layout.time);
    return static_cast<int64_t>(r / time) * layout.stride_b +
           static_cast<int64_t>(r % time) * layout.stride_t;
  }
  return (row / layout.time) * layout.stride_b + (row % layout.time) * layout.stride_t;
}

// Elements before the first 16-byte boundary of a row (0 when the row starts aligned).
template <typename T>
FUSEDRL_HD __forceinline__ int unaligned_head(const void* ptr, int vocab) {
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  const int head = static_cast<int>((16 - addr % 16) % 16) / static_cast<int>(sizeof(T));
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
FUSEDRL_HD __forceinline__ float safe_max(float m) { return m == -kInf ? 0.f : m; }

FUSEDRL_HD __forceinline__ void rescale_to(Stats& st, float new_m) {
  const float scale = st.s == 0.f ? 0.f : expf(st.m - safe_max(new_m));
  st.s *= scale;
  st.t *= scale;
  st.m = new_m;
}

FUSEDRL_HD __forceinline__ void accumulate(Stats& st, float z) {
  const float e = expf(z - safe_max(st.m));
  st.s += e;
  st.t += e > 0.f ? e * z : 0.f;  // -inf logits: p = 0 contributes 0, not 0 * -inf
}

FUSEDRL_HD __forceinline__ Stats merge(const Stats& a, const Stats& b) {
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
FUSEDRL_HD Stats block_reduce(Stats st) {
#ifndef __CUDA_ARCH__
  return st;  // a block of one thread
#else
  __shared__ float sm[kWarps], ss[kWarps], stt[kWarps];
  __shared__ Stats total;
  for (int offset = 16; offset > 0; offset >>= 1) {
    Stats other;
    other.m = __shfl_xor_sync(0xffffffffu, st.m, offset);
    other.s = __shfl_xor_sync(0xffffffffu, st.s, offset);
    other.t = __shfl_xor_sync(0xffffffffu, st.t, offset);
    st = merge(st, other);
  }
  const int warp = thread_rank() / 32;
  const int lane = thread_rank() % 32;
  if (lane == 0) {
    sm[warp] = st.m;
    ss[warp] = st.s;
    stt[warp] = st.t;
  }
  block_sync();
  if (warp == 0) {
    Stats w;
    if (lane < static_cast<int>(block_threads() / 32)) {  // the cluster kernel's blocks are smaller
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
  block_sync();
  const Stats result = total;
  block_sync();  // `total` is reused by the next row of the grid-stride loop
  return result;
#endif
}

// The exact online softmax (running max per thread, then a block merge): the fallback for rows
// whose sums relative to the label logit overflow.
template <typename T, bool kCap>
FUSEDRL_HD Stats row_stats_online(const T* row, int vocab, const Reader<T, kCap>& read) {
  Stats st;
  const float inv_temperature = read.inv_temperature;
  const int head = unaligned_head<T>(row, vocab);
  for (int j = thread_rank(); j < head; j += block_threads()) {
    const float z = read.value(to_float(row[j])) * inv_temperature;
    if (z > st.m) rescale_to(st, z);
    accumulate(st, z);
  }
  constexpr int kPack = Pack<T>::kSize;
  const int packs = (vocab - head) / kPack;
  const auto* packed = reinterpret_cast<const Pack<T>*>(row + head);
  for (int i = thread_rank(); i < packs; i += block_threads()) {
    const Pack<T> p = packed[i];
    float z[kPack];
    float pack_max = -kInf;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      z[k] = read.value(to_float(p.v[k])) * inv_temperature;
      pack_max = fmaxf(pack_max, z[k]);
    }
    if (pack_max > st.m) rescale_to(st, pack_max);
#pragma unroll
    for (int k = 0; k < kPack; ++k) accumulate(st, z[k]);
  }
  for (int j = head + packs * kPack + thread_rank(); j < vocab; j += block_threads()) {
    const float z = read.value(to_float(row[j])) * inv_temperature;
    if (z > st.m) rescale_to(st, z);
    accumulate(st, z);
  }
  return block_reduce(st);
}

// Block-wide sum of two floats (any block of at most kThreads); every thread gets the result.
FUSEDRL_HD float2 block_sum2(float a, float b) {
#ifndef __CUDA_ARCH__
  return make_float2(a, b);  // a block of one thread
#else
  __shared__ float2 partial[kWarps];
  __shared__ float2 total;
  for (int offset = 16; offset > 0; offset >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, offset);
    b += __shfl_xor_sync(0xffffffffu, b, offset);
  }
  const int warp = thread_rank() / 32;
  const int lane = thread_rank() % 32;
  if (lane == 0) partial[warp] = make_float2(a, b);
  block_sync();
  if (warp == 0) {
    float2 w = lane < static_cast<int>(block_threads() / 32) ? partial[lane] : make_float2(0.f, 0.f);
    for (int offset = 16; offset > 0; offset >>= 1) {
      w.x += __shfl_xor_sync(0xffffffffu, w.x, offset);
      w.y += __shfl_xor_sync(0xffffffffu, w.y, offset);
    }
    if (lane == 0) total = w;
  }
  block_sync();
  const float2 result = total;
  block_sync();  // `total` is reused by the next row of the grid-stride loop
  return result;
#endif
}

// Sums of one element relative to the reference: d = y - ref clamped at kFloor (NaN kept).
struct RefSums {
  float scale2;  // log2(e) / T
  float ref;     // the reference logit in base-2 units
  float s = 0.f;
  float t = 0.f;
  FUSEDRL_HD __forceinline__ void add(float x) {
    const float d = max_nan(fmaf(x, scale2, -ref), kFloor);
    const float e = ex2(d);
    s += e;
    t = fmaf(e, d, t);
  }
};

struct RowStats {
  float lse;      // nats
  float entropy;  // lse - sum_j p_j z_j, nats: from the sums relative to the label, not as that
                  // difference (whose terms both carry the label logit: ulps of it, not of H)
};

// One read of the row (see the file comment); `ref_value` is a value of the row as read (the
// label's).
template <typename T, bool kCap>
FUSEDRL_HD RowStats row_stats(const T* row, int vocab, const Reader<T, kCap>& read,
                              float ref_value) {
  const float scale2 = kLog2e * read.inv_temperature;
  RefSums acc{scale2, max_nan(ref_value * scale2, kFloor)};
  const int head = unaligned_head<T>(row, vocab);
  for (int j = thread_rank(); j < head; j += block_threads()) acc.add(read.value(to_float(row[j])));
  constexpr int kPack = Pack<T>::kSize;
  const int packs = (vocab - head) / kPack;
  const auto* packed = reinterpret_cast<const Pack<T>*>(row + head);
  for (int i = thread_rank(); i < packs; i += block_threads()) {
    const Pack<T> p = packed[i];
#pragma unroll
    for (int k = 0; k < kPack; ++k) acc.add(read.value(to_float(p.v[k])));
  }
  for (int j = head + packs * kPack + thread_rank(); j < vocab; j += block_threads()) {
    acc.add(read.value(to_float(row[j])));
  }
  const float2 sums = block_sum2(acc.s, acc.t);
  const float mean_d = sums.y / sums.x;
  // A reference at kFloor (a label logit of -inf, or one that scales to kFloor) says nothing
  // about the row: its offsets would all be 0 and count each element as p = 1.
  if (acc.ref > kFloor && sums.x < kInf && fabsf(sums.y) < kInf && mean_d == mean_d) {
    const float log2_sum = log2f(sums.x);
    return {(acc.ref + log2_sum) * kLn2, (log2_sum - mean_d) * kLn2};
  }
  const Stats st = row_stats_online(row, vocab, read);
  // No logit above kFloor (all -inf): no distribution, NaN as in the Triton kernels.
  const bool undefined = st.m == kInf || st.m * kLog2e <= kFloor;
  const float lse = undefined ? float_from_bits(0x7fc00000u) : st.m + logf(st.s);
  return {lse, lse - st.t / st.s};
}

// ------------------------------------------------------------------------------ gradient sweep
// d loss / d logit_j = p_j (k0 + k1 log2 p_j), plus dlogp / T at the label (written separately):
// k0 = -(dlogp + dH H) / T, k1 = -dH ln2 / T, log2 p_j = y_j - lse2. Under a soft cap each entry
// is that of v_j = tanh(cap x_j) times d v / d x = 4 cap r_j (1 - r_j) (`capped`): 4 cap is folded
// into k0, k1 and the label term, r (1 - r) is one more FFMA and FMUL per element.
struct RowGrad {
  int label;
  float label_logit;  // as stored, read before the row is overwritten (in place)
  float lse2;
  float k0;
  float k1;
  float scale2;
  float label_term;  // dlogp / T
  float cap2;        // Reader::cap2

  template <typename T, bool kCap>
  FUSEDRL_HD static RowGrad make(int label, float label_logit, float lse, float entropy,
                                 float dlogp, float dentropy, const Reader<T, kCap>& read) {
    const float inv_temperature = read.inv_temperature;
    const float slope = kCap ? 2.f * kLn2 * read.cap2 : 1.f;  // 4 cap
    return RowGrad{label,
                   label_logit,
                   lse * kLog2e,
                   -(dlogp + dentropy * entropy) * inv_temperature * slope,
                   -dentropy * kLn2 * inv_temperature * slope,
                   kLog2e * inv_temperature,
                   dlogp * inv_temperature * slope,
                   read.cap2};
  }

  // The entry of a value v as read (v = x without a cap).
  template <bool kEntropy>
  FUSEDRL_HD __forceinline__ float p_of(float v) const {
    const float log2_p = fmaf(v, scale2, -lse2);
    if (kEntropy) {
      const float clamped = max_nan(log2_p, kFloor);  // -inf: 0 * finite, not 0 * -inf
      return ex2(clamped) * fmaf(k1, clamped, k0);
    }
    return ex2(log2_p) * k0;  // -inf: ex2 gives 0
  }

  // d loss / d x of a stored logit x, the label's one-hot term aside.
  template <typename T, bool kEntropy, bool kCap>
  FUSEDRL_HD __forceinline__ float p_term(float x) const {
    if (!kCap) return p_of<kEntropy>(x);
    const float2 v = capped<T>(x, cap2);
    return p_of<kEntropy>(v.x) * v.y;
  }

  // The label's entry, its one-hot term dlogp / T included.
  template <typename T, bool kEntropy, bool kCap>
  FUSEDRL_HD __forceinline__ float label_entry() const {
    if (!kCap) return p_of<kEntropy>(label_logit) + label_term;
    const float2 v = capped<T>(label_logit, cap2);
    return (p_of<kEntropy>(v.x) + label_term) * v.y;
  }
};

template <typename T, bool kEntropy, bool kCap>
FUSEDRL_HD void write_row_grad(const T* row, T* out, int vocab, const RowGrad& f) {
  const int head = unaligned_head<T>(row, vocab);
  constexpr int kPack = Pack<T>::kSize;
  const int packs = (vocab - head) / kPack;
  if (head != unaligned_head<T>(out, vocab)) {  // input and output disagree on alignment
    const auto* packed_in = reinterpret_cast<const Pack<T>*>(row + head);
    for (int i = packs - 1 - static_cast<int>(thread_rank()); i >= 0; i -= block_threads()) {
      const Pack<T> p = packed_in[i];
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        out[head + i * kPack + k] = from_float<T>(f.p_term<T, kEntropy, kCap>(to_float(p.v[k])));
      }
    }
  } else {
    const auto* packed_in = reinterpret_cast<const Pack<T>*>(row + head);
    auto* packed_out = reinterpret_cast<Pack<T>*>(out + head);
    for (int i = packs - 1 - static_cast<int>(thread_rank()); i >= 0; i -= block_threads()) {
      const Pack<T> p = packed_in[i];
      Pack<T> g;
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        g.v[k] = from_float<T>(f.p_term<T, kEntropy, kCap>(to_float(p.v[k])));
      }
      packed_out[i] = g;
    }
  }
  for (int j = head + packs * kPack + thread_rank(); j < vocab; j += block_threads()) {
    out[j] = from_float<T>(f.p_term<T, kEntropy, kCap>(to_float(row[j])));
  }
  for (int j = thread_rank(); j < head; j += block_threads()) {
    out[j] = from_float<T>(f.p_term<T, kEntropy, kCap>(to_float(row[j])));
  }
  block_sync();  // the label's entry last: another thread's pack store covered it
  if (thread_rank() == 0) out[f.label] = from_float<T>(f.label_entry<T, kEntropy, kCap>());
}

template <typename T, bool kCap>
FUSEDRL_HD void write_row_grad(const T* row, T* out, int vocab, const RowGrad& f, bool entropy) {
  if (entropy) {
    write_row_grad<T, true, kCap>(row, out, vocab, f);
  } else {
    write_row_grad<T, false, kCap>(row, out, vocab, f);
  }
}

template <typename T>
FUSEDRL_HD void write_row_zeros(T* out, int vocab) {
  for (int j = thread_rank(); j < vocab; j += block_threads()) out[j] = from_float<T>(0.f);
}

// ------------------------------------------------------------------------------ token scalars
FUSEDRL_HD __forceinline__ float clampf(float x, float lo, float hi) {
  return fminf(fmaxf(x, lo), hi);
}

// d max(a, b): the larger branch's derivative, half of each at a tie (torch.maximum).
FUSEDRL_HD __forceinline__ float select_max_grad(float a, float b, float da, float db) {
  return a > b ? da : (b > a ? db : 0.5f * (da + db));
}

FUSEDRL_HD float policy_dlogp(float logp, float old, float adv, float low, float high,
                              const TokenLossParams& p) {
  const float raw_log_ratio = logp - old;
  const float ratio = expf(clampf(raw_log_ratio, -kLogRatioClamp, kLogRatioClamp));
  const bool inside_clamp = raw_log_ratio >= -kLogRatioClamp && raw_log_ratio <= kLogRatioClamp;
  const float dratio = inside_clamp ? ratio : 0.f;
  const float clipped = fminf(fmaxf(ratio, low), high);
  if (p.loss == kLossCispo) return -clipped * adv;
  if (p.loss == kLossSapo) {
    const float tau = adv > 0.f ? p.tau_pos : p.tau_neg;
    const float gate = 1.f / (1.f + expf(-tau * (ratio - 1.f)));
    return -4.f * gate * (1.f - gate) * dratio * adv;
  }
  if (p.loss == kLossPg) return -adv;
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

FUSEDRL_HD float kl_dlogp(float logp, float ref, int kind) {
  const float delta = logp - ref;
  switch (kind) {
    case kKlK1:
      return 1.f;
    case kKlK2:
    case kKlStraightThrough:
      return delta;
    case kKlAbs:
      return delta > 0.f ? 1.f : (delta < 0.f ? -1.f : 0.f);
    case kKlK3: {
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
// The token's d loss / d logp and d loss / dH from its row statistics, as the gradient sweep's
// constants; writes logp and entropy unless logp_out is nullptr. One thread per row calls it.
// `label_logit` as stored, `label_value` as read (capped).
template <typename T, bool kCap>
FUSEDRL_HD RowGrad token_row_grad(const TokenLossInputs& in, const TokenLossParams& params,
                                  const Reader<T, kCap>& read, int64_t row, int label,
                                  float label_logit, float label_value, float lse, float entropy,
                                  float* logp_out, float* entropy_out) {
  const float logp = label_value * read.inv_temperature - lse;
  const float old = in.old_logp != nullptr ? in.old_logp[row] : logp;
  const float low = in.low != nullptr ? in.low[row] : 0.f;
  const float high = in.high != nullptr ? in.high[row] : 0.f;
  float d = policy_dlogp(logp, old, in.advantages[row], low, high, params);
  if (in.is_weight != nullptr) d *= in.is_weight[row];
  // A NaN input the token's loss reads makes its row's gradient NaN, as its loss term is (the
  // clamps and selects of policy_dlogp would drop it; docs/losses.md, "NaN inputs").
  bool unread = old != old;  // (NaN: IEEE compares, no fast-math in this build)
  if (params.kl != kKlNone) {
    d += params.beta * kl_dlogp(logp, in.ref_logp[row], params.kl);
    unread = unread || in.ref_logp[row] != in.ref_logp[row];
  }
  if (unread) d = float_from_bits(0x7fc00000u);
  const float agg = in.agg_weight[row];
  if (logp_out != nullptr) {
    logp_out[row] = logp;
    entropy_out[row] = entropy;
  }
  const float coef = in.entropy_coef != nullptr ? *in.entropy_coef : params.entropy_coef;
  return RowGrad::make(label, label_logit, lse, entropy, d * agg, -coef * agg, read);
}

// Each kernel's body is a function of its rows (first, first + stride, ...): the kernel passes its
// block's grid-stride rows, tests/cuda_host_kernels.cu all rows on the host.
template <typename T, bool kCap>
FUSEDRL_HD void logprobs_forward_rows(const T* logits, RowLayout layout, const int64_t* labels,
                                      const int8_t* valid, RowRead read, float* logp, float* lse,
                                      float* entropy, int64_t first, int64_t stride) {
  const int vocab = static_cast<int>(layout.vocab);
  for (int64_t row = first; row < layout.rows; row += stride) {
    if (valid != nullptr && valid[row] == 0) {
      if (thread_rank() == 0) logp[row] = lse[row] = entropy[row] = 0.f;
      continue;
    }
    const T* row_ptr = logits + row_offset(row, layout);
    const auto reader = Reader<T, kCap>::make(read, row);
    const float label_value = reader.value(to_float(row_ptr[labels[row]]));
    const RowStats st = row_stats(row_ptr, vocab, reader, label_value);
    if (thread_rank() == 0) {
      logp[row] = label_value * reader.inv_temperature - st.lse;
      lse[row] = st.lse;
      entropy[row] = st.entropy;
    }
  }
}

template <typename T, bool kCap>
__global__ void __launch_bounds__(kThreads)
    logprobs_forward_kernel(const T* logits, RowLayout layout, const int64_t* labels,
                            const int8_t* valid, RowRead read, float* logp, float* lse,
                            float* entropy) {
  logprobs_forward_rows<T, kCap>(logits, layout, labels, valid, read, logp, lse, entropy,
                                 blockIdx.x, gridDim.x);
}

template <typename T, bool kCap>
FUSEDRL_HD void logits_grad_rows(const T* logits, T* out, RowLayout layout, RowLayout out_layout,
                                 const int64_t* labels, const float* lse, const float* entropy,
                                 const float* dlogp, const float* dentropy, RowRead read,
                                 int64_t first, int64_t stride) {
  const int vocab = static_cast<int>(layout.vocab);
  for (int64_t row = first; row < layout.rows; row += stride) {
    T* out_row = out + row_offset(row, out_layout);
    const float row_dlogp = dlogp[row];
    const float row_dentropy = dentropy != nullptr ? dentropy[row] : 0.f;
    if (row_dlogp == 0.f && row_dentropy == 0.f) {
      write_row_zeros(out_row, vocab);
    } else {
      const T* row_ptr = logits + row_offset(row, layout);
      const int label = static_cast<int>(labels[row]);
      const RowGrad f = RowGrad::make(label, to_float(row_ptr[label]), lse[row], entropy[row],
                                      row_dlogp, row_dentropy, Reader<T, kCap>::make(read, row));
      block_sync();  // in place: every thread has read the label logit before any write
      write_row_grad<T, kCap>(row_ptr, out_row, vocab, f, dentropy != nullptr);
    }
    block_sync();  // in place: the next row's reads never overlap, but keep blocks in step
  }
}

template <typename T, bool kCap>
__global__ void __launch_bounds__(kThreads)
    logits_grad_kernel(const T* logits, T* out, RowLayout layout, RowLayout out_layout,
                       const int64_t* labels, const float* lse, const float* entropy,
                       const float* dlogp, const float* dentropy, RowRead read) {
  logits_grad_rows<T, kCap>(logits, out, layout, out_layout, labels, lse, entropy, dlogp,
                            dentropy, read, blockIdx.x, gridDim.x);
}

// `shared_grad`: the row's gradient constants, made by thread 0 for the block (shared memory).
template <typename T, bool kCap>
FUSEDRL_HD void fused_token_loss_rows(const T* logits, T* grad, RowLayout layout,
                                      RowLayout grad_layout, const TokenLossInputs& in,
                                      const TokenLossParams& params, float* logp_out,
                                      float* entropy_out, RowGrad* shared_grad, int64_t first,
                                      int64_t stride) {
  const int vocab = static_cast<int>(layout.vocab);
  for (int64_t row = first; row < layout.rows; row += stride) {
    T* grad_row = grad + row_offset(row, grad_layout);
    if (in.valid[row] == 0) {
      write_row_zeros(grad_row, vocab);
      if (thread_rank() == 0) logp_out[row] = entropy_out[row] = 0.f;
      continue;
    }
    const T* row_ptr = logits + row_offset(row, layout);
    const int label = static_cast<int>(in.labels[row]);
    const float label_logit = to_float(row_ptr[label]);  // before any write (block_sum2 syncs)
    const auto reader = Reader<T, kCap>::make(params.read, row);
    const float label_value = reader.value(label_logit);
    const RowStats st = row_stats(row_ptr, vocab, reader, label_value);
    if (thread_rank() == 0) {
      *shared_grad = token_row_grad(in, params, reader, row, label, label_logit, label_value,
                                    st.lse, st.entropy, logp_out, entropy_out);
    }
    block_sync();
    const RowGrad f = *shared_grad;
    // The entropy term where the row has one (a coefficient of 0, from the host or the device,
    // or a row of aggregation weight 0: k1 = 0, and the term would add p * 0).
    write_row_grad<T, kCap>(row_ptr, grad_row, vocab, f, f.k1 != 0.f);
    block_sync();  // shared_grad is rewritten by the next row
  }
}

template <typename T, bool kCap>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    fused_token_loss_kernel(const T* logits, T* grad, RowLayout layout, RowLayout grad_layout,
                            TokenLossInputs in, TokenLossParams params, float* logp_out,
                            float* entropy_out) {
  __shared__ RowGrad shared_grad;
  fused_token_loss_rows<T, kCap>(logits, grad, layout, grad_layout, in, params, logp_out,
                                 entropy_out, &shared_grad, blockIdx.x, gridDim.x);
}

// ------------------------------------------------------------------------------ sm_90: one read
// The fused loss with exactly one read and one write of each row: a thread-block cluster of
// kClusterSize CTAs takes a row, each CTA loads its slice of the row's 16-byte packs into shared
// memory while summing it (sweep 1), the CTAs' partial sums are merged through distributed shared
// memory, and each CTA writes its slice's gradient from its on-chip copy. The elements before the
// row's first 16-byte boundary and after its last whole pack (< 16 in all) are the last CTA's, read
// from global memory twice. Rows with overflowing sums take the exact online softmax, also from
// shared memory.
constexpr int kClusterSize = 8;       // portable cluster size
constexpr int kClusterThreads = 256;  // per CTA
// The oldest (virtual) architecture whose code has the cluster kernel's body: thread-block
// clusters and distributed shared memory exist from sm_90 on. A macro, for the #if in the kernel.
#define FUSEDRL_CLUSTER_ARCH 90

namespace cg = cooperative_groups;

struct ClusterRow {
  int head;      // elements before the first 16-byte boundary
  int packs;     // whole 16-byte packs after them
  int per_cta;   // packs per CTA (the last may hold fewer)
  int first;     // this CTA's first pack
  int count;     // this CTA's packs
};

template <typename T>
__device__ __forceinline__ ClusterRow cluster_row(const T* row_ptr, int vocab, int rank) {
  ClusterRow r;
  r.head = unaligned_head<T>(row_ptr, vocab);
  r.packs = (vocab - r.head) / Pack<T>::kSize;
  r.per_cta = (r.packs + kClusterSize - 1) / kClusterSize;
  r.first = rank * r.per_cta;
  const int left = r.packs - r.first;
  r.count = left < 0 ? 0 : (left < r.per_cta ? left : r.per_cta);
  return r;
}

// The elements outside the packs: [0, head) and [head + packs * kPack, vocab).
template <typename T, typename Fn>
__device__ __forceinline__ void for_each_loose_element(const ClusterRow& r, int vocab, Fn&& fn) {
  const int tail = r.head + r.packs * Pack<T>::kSize;
  for (int j = thread_rank(); j < r.head + (vocab - tail); j += block_threads()) {
    fn(j < r.head ? j : tail + (j - r.head));
  }
}

// Sum of a float2 over the CTAs of the cluster, in rank order (every CTA gets the same bits).
// A template: cg::cluster_group exists only where the device code is compiled for sm_90+.
template <typename Cluster>
__device__ float2 cluster_sum2(Cluster& cluster, float2* mine, float2 value) {
  __shared__ float2 total;
  if (thread_rank() == 0) *mine = value;
  cluster.sync();
  if (thread_rank() == 0) {
    float2 acc = make_float2(0.f, 0.f);
    for (int r = 0; r < kClusterSize; ++r) {
      const float2 other = *cluster.map_shared_rank(mine, r);
      acc.x += other.x;
      acc.y += other.y;
    }
    total = acc;
  }
  block_sync();
  return total;
}

template <typename T, bool kEntropy, bool kCap>
__device__ void write_slice_grad(const Pack<T>* slice, const T* row_ptr, T* out,
                                 const ClusterRow& r, int vocab, bool last_rank,
                                 const RowGrad& f) {
  constexpr int kPack = Pack<T>::kSize;
  if (unaligned_head<T>(out, vocab) == r.head) {
    auto* packed_out = reinterpret_cast<Pack<T>*>(out + r.head) + r.first;
    for (int i = thread_rank(); i < r.count; i += block_threads()) {
      const Pack<T> p = slice[i];
      Pack<T> g;
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        g.v[k] = from_float<T>(f.p_term<T, kEntropy, kCap>(to_float(p.v[k])));
      }
      packed_out[i] = g;
    }
  } else {  // the gradient rows are aligned differently from the logits: scalar stores
    T* slice_out = out + r.head + static_cast<int64_t>(r.first) * kPack;
    for (int i = thread_rank(); i < r.count; i += block_threads()) {
      const Pack<T> p = slice[i];
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        slice_out[i * kPack + k] = from_float<T>(f.p_term<T, kEntropy, kCap>(to_float(p.v[k])));
      }
    }
  }
  if (last_rank) {
    for_each_loose_element<T>(r, vocab, [&](int j) {
      out[j] = from_float<T>(f.p_term<T, kEntropy, kCap>(to_float(row_ptr[j])));
    });
  }
}

template <typename T, bool kCap>
__global__ void __launch_bounds__(kClusterThreads)
    fused_token_loss_cluster_kernel(const T* logits, T* grad, RowLayout layout,
                                    RowLayout grad_layout, TokenLossInputs in,
                                    TokenLossParams params, float* logp_out, float* entropy_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= FUSEDRL_CLUSTER_ARCH * 10
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const bool last_rank = rank == kClusterSize - 1;
  extern __shared__ __align__(16) unsigned char smem[];
  auto* slice = reinterpret_cast<Pack<T>*>(smem);
  __shared__ float2 partial;     // this CTA's sums, read by the others through DSMEM
  __shared__ float2 partial_m;   // the fallback's max, then its rescaled (sum, sum z)
  __shared__ float2 partial_st;
  __shared__ RowGrad shared_grad;
  __shared__ int label_owner;
  constexpr int kPack = Pack<T>::kSize;
  const int vocab = static_cast<int>(layout.vocab);
  const int64_t clusters = gridDim.x / kClusterSize;
  for (int64_t row = blockIdx.x / kClusterSize; row < layout.rows; row += clusters) {
    T* grad_row = grad + row_offset(row, grad_layout);
    const T* row_ptr = logits + row_offset(row, layout);
    if (in.valid[row] == 0) {
      for (int j = rank * block_threads() + thread_rank(); j < vocab; j += kClusterSize * block_threads()) {
        grad_row[j] = from_float<T>(0.f);
      }
      if (rank == 0 && thread_rank() == 0) logp_out[row] = entropy_out[row] = 0.f;
      cluster.sync();
      continue;
    }
    const int label = static_cast<int>(in.labels[row]);
    const float label_logit = to_float(row_ptr[label]);  // before any write: cluster.sync below
    const auto reader = Reader<T, kCap>::make(params.read, row);
    const float label_value = reader.value(label_logit);
    const float scale2 = kLog2e * reader.inv_temperature;
    const ClusterRow r = cluster_row(row_ptr, vocab, rank);
    // Sweep 1: the slice into shared memory, summed relative to the label logit on the way.
    RefSums acc{scale2, max_nan(label_value * scale2, kFloor)};
    const auto* packed = reinterpret_cast<const Pack<T>*>(row_ptr + r.head) + r.first;
    for (int i = thread_rank(); i < r.count; i += block_threads()) {
      const Pack<T> p = packed[i];
      slice[i] = p;
#pragma unroll
      for (int k = 0; k < kPack; ++k) acc.add(reader.value(to_float(p.v[k])));
    }
    if (last_rank) {
      for_each_loose_element<T>(r, vocab, [&](int j) { acc.add(reader.value(to_float(row_ptr[j]))); });
    }
    const float2 sums = cluster_sum2(cluster, &partial, block_sum2(acc.s, acc.t));
    float lse, entropy;  // see RowStats
    const float mean_d = sums.y / sums.x;
    // uniform over the cluster; a reference at kFloor says nothing about the row (see row_stats)
    if (acc.ref > kFloor && sums.x < kInf && fabsf(sums.y) < kInf && mean_d == mean_d) {
      const float log2_sum = log2f(sums.x);
      lse = (acc.ref + log2_sum) * kLn2;
      entropy = (log2_sum - mean_d) * kLn2;
    } else {  // the exact online softmax, from the on-chip slices
      Stats st;
      auto online = [&](float x) {
        const float z = reader.value(x) * reader.inv_temperature;
        if (z > st.m) rescale_to(st, z);
        accumulate(st, z);
      };
      for (int i = thread_rank(); i < r.count; i += block_threads()) {
        const Pack<T> p = slice[i];
#pragma unroll
        for (int k = 0; k < kPack; ++k) online(to_float(p.v[k]));
      }
      if (last_rank) for_each_loose_element<T>(r, vocab, [&](int j) { online(to_float(row_ptr[j])); });
      st = block_reduce(st);
      // Rescale each CTA's sums to the cluster-wide max, then add them up in rank order.
      if (thread_rank() == 0) partial_m = make_float2(st.m, 0.f);
      cluster.sync();
      __shared__ float row_max;
      if (thread_rank() == 0) {
        float m = -kInf;
        for (int q = 0; q < kClusterSize; ++q) m = fmaxf(m, cluster.map_shared_rank(&partial_m, q)->x);
        row_max = m;
      }
      block_sync();
      const float scale = st.s == 0.f ? 0.f : expf(st.m - safe_max(row_max));
      const float2 total = cluster_sum2(cluster, &partial_st, make_float2(st.s * scale, st.t * scale));
      const bool undefined = row_max == kInf || row_max * kLog2e <= kFloor;  // see row_stats
      lse = undefined ? float_from_bits(0x7fc00000u) : safe_max(row_max) + logf(total.x);
      entropy = lse - total.y / total.x;
    }
    if (thread_rank() == 0) {
      // Every CTA derives the same scalars; rank 0 writes logp and entropy.
      shared_grad = token_row_grad(in, params, reader, row, label, label_logit, label_value, lse,
                                   entropy, rank == 0 ? logp_out : nullptr, entropy_out);
      const int in_packs = label - r.head;
      const bool loose = in_packs < 0 || in_packs >= r.packs * kPack;
      label_owner = loose ? kClusterSize - 1 : (in_packs / kPack) / r.per_cta;
    }
    block_sync();
    const RowGrad f = shared_grad;
    // Sweep 2, from shared memory: the only other read of the row is the loose elements'.
    if (f.k1 != 0.f) {  // the entropy term (see fused_token_loss_rows)
      write_slice_grad<T, true, kCap>(slice, row_ptr, grad_row, r, vocab, last_rank, f);
    } else {
      write_slice_grad<T, false, kCap>(slice, row_ptr, grad_row, r, vocab, last_rank, f);
    }
    block_sync();  // the label's entry after this CTA's own store of it
    if (rank == label_owner && thread_rank() == 0) {
      grad_row[label] = from_float<T>(f.k1 != 0.f ? f.label_entry<T, true, kCap>()
                                                                 : f.label_entry<T, false, kCap>());
    }
    cluster.sync();  // no CTA rewrites `partial` or its slice while another still reads them
  }
#else
  __trap();  // never launched: see cluster_state, which checks the loaded code's version
#endif
}

// Dynamic shared memory of one CTA of the cluster kernel for rows of `vocab` elements of `bytes`.
int64_t cluster_smem_bytes(int64_t vocab, int64_t bytes) {
  const int64_t packs = vocab * bytes / 16 + 1;
  return (packs + kClusterSize - 1) / kClusterSize * 16;
}

// ------------------------------------------------------------------------------ kernel choice
// Whether the cluster kernel may run is a fact about the code the driver loaded for it, not about
// the device: its body exists only in code compiled for a virtual architecture >= compute_90
// (the #if above); everywhere else it is __trap(), which kills the CUDA context. Checking the
// device's compute capability is not enough: an extension built for `8.0+PTX` has no sm_90 cubin,
// so on an H100 the driver JIT-compiles the compute_80 PTX for sm_90, and the cluster kernel it
// gets is the trap. Nor is the code's binary version: that JIT code reports binaryVersion 90 (the
// SASS target), as does a cubin built with arch=compute_80,code=sm_90. What decides is the
// version `__CUDA_ARCH__` had, and cudaFuncGetAttributes reports it for the code loaded on the
// current device as ptxVersion (the virtual architecture the function was compiled from). So
// the cluster kernel is chosen only when its own ptxVersion is >= 90 and the device launches
// clusters (binaryVersion >= 90 is checked too, at no cost: it cannot be lower than ptxVersion).
// A query, not a launch: nothing runs that could trap, and it is made once per device.
// tests/test_cuda_build.py proves on object code, image by image, that the cluster kernel has a
// body exactly where the image's virtual architecture is >= compute_90, and runs this choice
// against a stub CUDA runtime.
struct ClusterState {
  bool usable = false;
  int ptx_version = 0;       // of the loaded cluster kernel (0: the query failed)
  int binary_version = 0;
  int max_dynamic_smem = 0;  // the kernel's dynamic shared memory attribute, set at its maximum
  int attribute_sets = 0;    // cudaFuncSetAttribute calls for it on this device
};

// Devices per process whose state is kept; a device beyond it gets the two-sweep kernel.
constexpr int kMaxDevices = 128;

// Once per kernel and device: function attributes are per device (context), so is the dynamic
// shared memory limit, which is set here at its maximum (the opt-in limit less the kernel's
// static shared memory) so that no launch has to set it again.
ClusterState probe_cluster_kernel(const void* kernel, int device) {
  ClusterState s;
  cudaFuncAttributes attr{};
  int cluster_launch = 0, optin = 0;
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess ||
      cudaDeviceGetAttribute(&cluster_launch, cudaDevAttrClusterLaunch, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    // The runtime keeps the error as the last one: cleared, so that the two-sweep kernel's
    // launch reports its own (a module with no image for this device fails there too).
    (void)cudaGetLastError();
    return s;
  }
  s.ptx_version = attr.ptxVersion;
  s.binary_version = attr.binaryVersion;
  if (cluster_launch == 0 || attr.ptxVersion < FUSEDRL_CLUSTER_ARCH ||
      attr.binaryVersion < FUSEDRL_CLUSTER_ARCH) {
    return s;
  }
  const int max_dynamic = optin - static_cast<int>(attr.sharedSizeBytes);
  ++s.attribute_sets;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_dynamic) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return s;
  }
  s.usable = true;
  s.max_dynamic_smem = max_dynamic;
  return s;
}

template <typename T, bool kCap>
const ClusterState& cluster_state(int device) {
  static std::once_flag once[kMaxDevices];
  static ClusterState state[kMaxDevices];
  static const ClusterState none;
  if (device < 0 || device >= kMaxDevices) return none;
  std::call_once(once[device], [device] {
    state[device] = probe_cluster_kernel(
        reinterpret_cast<const void*>(fused_token_loss_cluster_kernel<T, kCap>), device);
  });
  return state[device];
}

// The one-read kernel when its loaded code has the body (cluster_state), its slices fit shared
// memory, and FUSEDRL_CUDA_ONE_READ is not "0" (set it to time the two-sweep kernel on the same
// GPU). The current device is the tensors' (bindings.cpp holds a guard).
template <typename T, bool kCap>
bool use_cluster_kernel(int64_t vocab) {
  const char* env = std::getenv("FUSEDRL_CUDA_ONE_READ");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const ClusterState& s = cluster_state<T, kCap>(device);
  return s.usable && cluster_smem_bytes(vocab, sizeof(T)) <= s.max_dynamic_smem;
}

// `*launched` false (and nothing queued) when no cluster fits on the GPU at once (an MPS or
// green-context SM limit can leave too few SMs for 8 CTAs of ~227 KB): the caller then runs the
// two-sweep kernel, as it does where the slices do not fit.
template <typename T, bool kCap>
cudaError_t launch_cluster(const T* logits, T* grad, RowLayout layout, RowLayout grad_layout,
                           TokenLossInputs inputs, TokenLossParams params, float* logp,
                           float* entropy, cudaStream_t stream, bool* launched) {
  const auto kernel = fused_token_loss_cluster_kernel<T, kCap>;
  const int64_t smem = cluster_smem_bytes(layout.vocab, sizeof(T));
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = kClusterSize;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.blockDim = dim3(kClusterThreads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  int active = 0;  // clusters that fit on the GPU at once: the grid, rows permitting
  config.gridDim = dim3(kClusterSize);
  cudaError_t err = cudaOccupancyMaxActiveClusters(&active, kernel, &config);
  *launched = err == cudaSuccess && active > 0;
  if (err != cudaSuccess || active <= 0) return err;
  const int64_t clusters = layout.rows < active ? layout.rows : active;
  config.gridDim = dim3(static_cast<unsigned>(clusters * kClusterSize));
  return cudaLaunchKernelEx(&config, kernel, logits, grad, layout, grad_layout, inputs, params,
                            logp, entropy);
}

int grid_for(int64_t rows) {
  // Enough blocks to fill any current GPU many times over; the kernels grid-stride beyond.
  constexpr int64_t kMaxBlocks = 1 << 20;
  return static_cast<int>(rows < kMaxBlocks ? (rows > 0 ? rows : 1) : kMaxBlocks);
}

// The fused kernel's grid: as many rows in flight as L2 holds, one block per SM at least (see
// fusedrl.kernels.logprobs.persistent_programs, the same rule for the Triton kernel).
int grid_for_l2(int64_t rows, int64_t row_bytes) {
  int device = 0, sms = 0, l2_bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device) != cudaSuccess ||
      sms <= 0) {
    return grid_for(rows);
  }
  int64_t per_sm = static_cast<int64_t>(l2_bytes) / (row_bytes * sms > 0 ? row_bytes * sms : 1);
  per_sm = per_sm < 1 ? 1 : (per_sm > kMinBlocksPerSm ? kMinBlocksPerSm : per_sm);
  const int64_t blocks = sms * per_sm;
  return static_cast<int>(rows < blocks ? (rows > 0 ? rows : 1) : blocks);
}

template <bool kValue>
using Flag = std::integral_constant<bool, kValue>;

// fn(T{}, Flag<kCap>{}) for the logits' dtype and whether they are read through a soft cap.
template <typename Fn>
cudaError_t dispatch(DType dtype, float cap, Fn&& fn) {
  const auto with_cap = [&](auto tag) {
    return cap != 0.f ? fn(tag, Flag<true>{}) : fn(tag, Flag<false>{});
  };
  switch (dtype) {
    case DType::kFloat32:
      return with_cap(float{});
    case DType::kFloat16:
      return with_cap(__half{});
    case DType::kBFloat16:
      return with_cap(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_logprobs_forward(const void* logits, DType dtype, RowLayout layout,
                                    const int64_t* labels, const int8_t* valid, RowRead read,
                                    float* logp, float* lse, float* entropy, cudaStream_t stream) {
  if (layout.rows == 0) return cudaSuccess;
  return dispatch(dtype, read.cap, [&](auto tag, auto cap) {
    using T = decltype(tag);
    logprobs_forward_kernel<T, decltype(cap)::value><<<grid_for(layout.rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), layout, labels, valid, read, logp, lse, entropy);
    return cudaGetLastError();
  });
}

cudaError_t launch_logits_grad(const void* logits, void* out, DType dtype, RowLayout layout,
                               RowLayout out_layout, const int64_t* labels, const float* lse,
                               const float* entropy, const float* dlogp, const float* dentropy,
                               RowRead read, cudaStream_t stream) {
  if (layout.rows == 0) return cudaSuccess;
  return dispatch(dtype, read.cap, [&](auto tag, auto cap) {
    using T = decltype(tag);
    logits_grad_kernel<T, decltype(cap)::value><<<grid_for(layout.rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), static_cast<T*>(out), layout, out_layout, labels, lse,
        entropy, dlogp, dentropy, read);
    return cudaGetLastError();
  });
}

cudaError_t launch_fused_token_loss(const void* logits, void* grad, DType dtype, RowLayout layout,
                                    RowLayout grad_layout, TokenLossInputs inputs,
                                    TokenLossParams params, float* logp, float* entropy,
                                    cudaStream_t stream) {
  if (layout.rows == 0) return cudaSuccess;
  return dispatch(dtype, params.read.cap, [&](auto tag, auto cap) {
    using T = decltype(tag);
    if (use_cluster_kernel<T, decltype(cap)::value>(layout.vocab)) {
      bool launched = false;
      const cudaError_t err = launch_cluster<T, decltype(cap)::value>(
          static_cast<const T*>(logits), static_cast<T*>(grad), layout, grad_layout, inputs,
          params, logp, entropy, stream, &launched);
      if (err != cudaSuccess || launched) return err != cudaSuccess ? err : cudaGetLastError();
    }
    const int blocks = grid_for_l2(layout.rows, layout.vocab * static_cast<int64_t>(sizeof(T)));
    fused_token_loss_kernel<T, decltype(cap)::value><<<blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(logits), static_cast<T*>(grad), layout, grad_layout, inputs, params,
        logp, entropy);
    return cudaGetLastError();
  });
}

cudaError_t query_cluster_kernel(DType dtype, ClusterKernelInfo* info) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  return dispatch(dtype, 0.f, [&](auto tag, auto) {
    const ClusterState& s = cluster_state<decltype(tag), false>(device);
    *info = ClusterKernelInfo{s.usable, s.ptx_version, s.binary_version, s.max_dynamic_smem,
                              s.attribute_sets};
    return cudaSuccess;
  });
}

}  // namespace fusedrl
