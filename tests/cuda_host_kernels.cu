// The CUDA extension's own kernel code on the CPU: csrc/fused_loss.cu's two-sweep kernels run
// their row functions (logprobs_forward_rows, logits_grad_rows, fused_token_loss_rows) here as
// one block of one thread over every row, built for the host by nvcc (fused_loss.cu's FUSEDRL_HD:
// the thread's rank is 0, the barrier and the block reductions are no-ops, ex2 / rcp / max.NaN
// their exact libm counterparts). Every line of those functions runs: the sweep relative to the
// label logit and its overflow fallback, the unaligned head and tail of each row, the per-token
// scalars of every loss and KL, the soft cap, per-token temperatures, the label's one-hot entry
// written last, in place. What it cannot check is the GPU's: the warp and block reductions, the
// cluster kernel, the approximate instructions (tests/test_gpu.py does, on a GPU).
//
// tests/test_cuda_host_kernels.py drives it as the ops of a fused backend against the oracle.
//   cuda_host_kernels OP DIR     OP: logprobs | grad | fused
// DIR holds params.txt ("name value" lines) and the arrays as raw native-endian files named
// after the kernels' arguments (absent: nullptr); the outputs are written beside them.
#include "fused_loss.cu"

#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace fusedrl {
namespace {  // fused_loss.cu's: the same translation unit

struct Files {
  std::string dir;

  template <typename X>
  std::vector<X> load(const std::string& name) const {
    std::ifstream in(dir + "/" + name, std::ios::binary);
    if (!in) return {};
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
    std::vector<X> out(bytes.size() / sizeof(X));
    std::memcpy(out.data(), bytes.data(), out.size() * sizeof(X));
    return out;
  }

  template <typename X>
  void save(const std::string& name, const std::vector<X>& values) const {
    std::ofstream out(dir + "/" + name, std::ios::binary);
    out.write(reinterpret_cast<const char*>(values.data()),
              static_cast<std::streamsize>(values.size() * sizeof(X)));
  }
};

std::map<std::string, double> read_params(const std::string& dir) {
  std::map<std::string, double> params;
  std::ifstream in(dir + "/params.txt");
  std::string name;
  double value = 0;
  while (in >> name >> value) params[name] = value;
  return params;
}

template <typename X>
const X* or_null(const std::vector<X>& v) {
  return v.empty() ? nullptr : v.data();
}

// The logits (and the gradient buffer) as T: "logits" holds their bits (params.dtype: DType).
template <typename T, bool kCap>
int run(const std::string& op, const Files& files, std::map<std::string, double>& p) {
  const int64_t rows = static_cast<int64_t>(p["rows"]);
  const int64_t vocab = static_cast<int64_t>(p["vocab"]);
  const RowLayout layout{rows, static_cast<int64_t>(p["time"]), vocab,
                         static_cast<int64_t>(p["time"]) * vocab, vocab};
  std::vector<T> logits = files.load<T>("logits");
  const std::vector<int64_t> labels = files.load<int64_t>("labels");
  const std::vector<int8_t> valid = files.load<int8_t>("valid");
  const std::vector<float> temperatures = files.load<float>("row_temps");
  const RowRead read{static_cast<float>(p["inv_temperature"]), or_null(temperatures),
                     static_cast<float>(p["cap"])};
  if (static_cast<int64_t>(logits.size()) != rows * vocab ||
      static_cast<int64_t>(labels.size()) != rows) {
    std::fprintf(stderr, "cuda_host_kernels: logits or labels of the wrong size\n");
    return 2;
  }
  std::vector<float> logp(rows), entropy(rows), lse(rows);
  const bool in_place = p["in_place"] != 0;
  std::vector<T> separate(in_place ? 0 : logits.size());
  T* out = in_place ? logits.data() : separate.data();
  if (op == "logprobs") {
    logprobs_forward_rows<T, kCap>(logits.data(), layout, labels.data(), or_null(valid), read,
                                   logp.data(), lse.data(), entropy.data(), 0, 1);
    files.save("logp", logp);
    files.save("lse", lse);
    files.save("entropy", entropy);
    return 0;
  }
  if (op == "grad") {
    const std::vector<float> lse_in = files.load<float>("lse");
    const std::vector<float> entropy_in = files.load<float>("entropy");
    const std::vector<float> dlogp = files.load<float>("dlogp");
    const std::vector<float> dentropy = files.load<float>("dentropy");
    logits_grad_rows<T, kCap>(logits.data(), out, layout, layout, labels.data(), lse_in.data(),
                              entropy_in.data(), dlogp.data(), or_null(dentropy), read, 0, 1);
  } else if (op == "fused") {
    const std::vector<float> advantages = files.load<float>("advantages");
    const std::vector<float> old_logp = files.load<float>("old_logp");
    const std::vector<float> ref_logp = files.load<float>("ref_logp");
    const std::vector<float> is_weight = files.load<float>("is_weight");
    const std::vector<float> agg_weight = files.load<float>("agg_weight");
    const std::vector<float> low = files.load<float>("low");
    const std::vector<float> high = files.load<float>("high");
    const std::vector<float> coef = files.load<float>("entropy_coef_tensor");
    const TokenLossInputs inputs{labels.data(),     valid.data(),      advantages.data(),
                                 or_null(old_logp), or_null(ref_logp), or_null(is_weight),
                                 agg_weight.data(), or_null(low),      or_null(high),
                                 or_null(coef)};
    const TokenLossParams params{static_cast<int>(p["loss"]),
                                 p["dual_clip"] != 0,
                                 static_cast<float>(p["dual_clip_c"]),
                                 p["has_delta"] != 0,
                                 static_cast<float>(p["delta"]),
                                 static_cast<float>(p["tau_pos"]),
                                 static_cast<float>(p["tau_neg"]),
                                 static_cast<int>(p["kl"]),
                                 static_cast<float>(p["beta"]),
                                 static_cast<float>(p["entropy_coef"]),
                                 read};
    RowGrad shared_grad{};
    fused_token_loss_rows<T, kCap>(logits.data(), out, layout, layout, inputs, params,
                                   logp.data(), entropy.data(), &shared_grad, 0, 1);
    files.save("logp", logp);
    files.save("entropy", entropy);
  } else {
    std::fprintf(stderr, "cuda_host_kernels: unknown op %s\n", op.c_str());
    return 2;
  }
  files.save("out", in_place ? logits : separate);
  return 0;
}

template <typename T>
int run_dtype(const std::string& op, const Files& files, std::map<std::string, double>& p) {
  return p["cap"] != 0 ? run<T, true>(op, files, p) : run<T, false>(op, files, p);
}

}  // namespace
}  // namespace fusedrl

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: cuda_host_kernels logprobs|grad|fused DIR\n");
    return 2;
  }
  const fusedrl::Files files{argv[2]};
  auto params = fusedrl::read_params(argv[2]);
  switch (static_cast<fusedrl::DType>(static_cast<int>(params["dtype"]))) {
    case fusedrl::DType::kFloat16:
      return fusedrl::run_dtype<__half>(argv[1], files, params);
    case fusedrl::DType::kBFloat16:
      return fusedrl::run_dtype<__nv_bfloat16>(argv[1], files, params);
    default:
      return fusedrl::run_dtype<float>(argv[1], files, params);
  }
}
