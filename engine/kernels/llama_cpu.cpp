// A Llama-family model's decoder layers in one native call, for CPU steps whose every new token is a row of the paged
// attention kernel (CpuAttention with packed keys): the same kernels, called in the same order on the same tensors
// as engine/models/llama.py's modules call them, so the result is the same to the bit. What it saves is the Python
// around them: a layer is ~10 module calls, argument parses and dispatches; at one decode row on one thread the
// interpreter and torch's argument handling took about 30% of a step here (perf record, by library).
//
// The kernels are reached through the dispatcher (their own translation units keep them private).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

namespace {

using OptTensor = c10::optional<at::Tensor>;
using NormFn = void(at::Tensor&, const at::Tensor&, const OptTensor&, const at::Tensor&, double);
using RopeFn = void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t);
using SiluFn = void(at::Tensor&, const at::Tensor&);
using KvWriteFn = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);
using AttentionFn = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, double, bool);
using LinearFn = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t);
using LinearInt8Fn = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                          int64_t);

template <typename Fn>
c10::TypedOperatorHandle<Fn> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

struct Kernels {
  c10::TypedOperatorHandle<NormFn> rms_norm = kernel<NormFn>("tokenline::rms_norm");
  c10::TypedOperatorHandle<RopeFn> rope = kernel<RopeFn>("tokenline::rotary_embedding");
  c10::TypedOperatorHandle<SiluFn> silu_and_mul = kernel<SiluFn>("tokenline::silu_and_mul");
  c10::TypedOperatorHandle<KvWriteFn> write_kv = kernel<KvWriteFn>("tokenline::write_kv_cache");
  c10::TypedOperatorHandle<AttentionFn> attention = kernel<AttentionFn>("tokenline::paged_decode_attention");
  c10::TypedOperatorHandle<LinearFn> linear = kernel<LinearFn>("tokenline::packed_linear");
  c10::TypedOperatorHandle<LinearFn> linear_silu_mul = kernel<LinearFn>("tokenline::packed_linear_silu_mul");
  c10::TypedOperatorHandle<LinearInt8Fn> linear_int8 = kernel<LinearInt8Fn>("tokenline::packed_linear_int8");
};

const Kernels& kernels() {
  static const Kernels k;
  return k;
}

// A layer's parameters, in the order engine.models.llama.LlamaForCausalLM.native_layer_params lists them: the two
// norms' weights, then for each of qkv, o, gate_up and down its packed bf16 weight, bias, int8 weight and int8
// scales (the last three may be None).
constexpr int64_t kNorms = 2, kPerLinear = 4, kLinears = 4, kPerLayer = kNorms + kPerLinear * kLinears;
enum Linear { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

struct Layer {
  const OptTensor* p;
  const at::Tensor& norm(int i) const { return *p[i]; }
  const OptTensor* linear(Linear which) const { return p + kNorms + kPerLinear * which; }
};

// Linear.forward with native packing: rows of x (copied if their layout does not suit the kernel) times the
// packed weight, the int8 one for steps of up to int8_max_rows rows where the layer has it.
at::Tensor linear(const at::Tensor& x, const OptTensor* w, int64_t n, int64_t int8_max_rows) {
  const at::Tensor rows = x.stride(1) != 1 || x.stride(0) % 2 ? x.contiguous() : x;
  at::Tensor out = at::empty({rows.size(0), n}, rows.options());
  if (w[2].has_value() && rows.size(0) <= int8_max_rows) {
    kernels().linear_int8.call(out, rows, *w[2], *w[3], w[1], n);
  } else {
    kernels().linear.call(out, rows, *w[0], w[1], n);
  }
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, const OptTensor& residual, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  kernels().rms_norm.call(out, x, residual, weight, eps);
  return out;
}

// x: the embedded tokens [tokens, hidden] (used as the residual stream, updated in place); the hidden states after
// the final norm come back. seq_lens: each token's position + 1, its row's causal length.
at::Tensor llama_layers(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slots,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cos_sin,
                        const c10::List<OptTensor>& params, const at::TensorList k_caches,
                        const at::TensorList v_caches, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t intermediate, double eps, double scale, int64_t int8_max_rows, bool query_tiles) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(v_caches.size() == k_caches.size(), "llama_layers: one K and one V cache per layer");
  TORCH_CHECK(static_cast<int64_t>(params.size()) == num_layers * kPerLayer + 1,
              "llama_layers: ", kPerLayer, " parameters a layer and the final norm's weight");
  TORCH_CHECK(num_layers > 0 && x.dim() == 2, "llama_layers takes [tokens, hidden] and at least one layer");
  const std::vector<OptTensor> p = params.vec();
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    for (int64_t i = 0; i < kPerLayer; ++i) {
      const bool optional = i >= kNorms && (i - kNorms) % kPerLinear != 0;
      TORCH_CHECK(optional || p[layer * kPerLayer + i].has_value(), "llama_layers: layer ", layer, " parameter ", i,
                  " is missing");
    }
  }
  TORCH_CHECK(p.back().has_value(), "llama_layers: the final norm's weight is missing");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const Kernels& k = kernels();
  at::Tensor residual = x, h;
  for (int64_t i = 0; i < num_layers; ++i) {
    const Layer layer{p.data() + i * kPerLayer};
    h = i == 0 ? rms_norm(x, layer.norm(0), c10::nullopt, eps) : rms_norm(h, layer.norm(0), residual, eps);
    at::Tensor qkv = linear(h, layer.linear(kQkv), q_size + 2 * kv_size, int8_max_rows);
    k.rope.call(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    const at::Tensor key = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
    k.write_kv.call(key, value, k_cache, v_cache, slots);
    at::Tensor attended = at::empty({tokens, q_size}, x.options());
    k.attention.call(attended, q, k_cache, v_cache, block_tables, seq_lens, scale, query_tiles);
    h = linear(attended, layer.linear(kO), hidden, int8_max_rows);
    h = rms_norm(h, layer.norm(1), residual, eps);
    const OptTensor* gate_up_w = layer.linear(kGateUp);
    at::Tensor act = at::empty({tokens, intermediate}, x.options());
    if (gate_up_w[2].has_value() && tokens <= int8_max_rows) {
      k.silu_and_mul.call(act, linear(h, gate_up_w, 2 * intermediate, int8_max_rows));
    } else {  // Linear.silu_mul: the same bits
      k.linear_silu_mul.call(act, h, *gate_up_w[0], gate_up_w[1], 2 * intermediate);
    }
    h = linear(act, layer.linear(kDown), hidden, int8_max_rows);
  }
  return rms_norm(h, *p.back(), residual, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenline, m) {
  m.def("llama_layers(Tensor(a!) x, Tensor positions, Tensor slots, Tensor block_tables, Tensor seq_lens, "
        "Tensor cos_sin, Tensor?[] params, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, int num_heads, "
        "int num_kv_heads, int head_dim, int intermediate, float eps, float scale, int int8_max_rows, "
        "bool query_tiles=True) -> Tensor");
  m.impl("llama_layers", c10::DispatchKey::CPU, &llama_layers);
}
