#include "model.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "attend_rows_scratch.h"
#include "ops.h"
#include "row_sampler.h"

namespace sg {

namespace ops {
bool cpu_has_avx2_fma_f16c() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
}  // namespace ops

namespace {

// Below this many elements (~100 us of work) an element-wise pass runs on the calling thread: a pool dispatch costs
// a worker wake-up, which on a loaded machine is a scheduler latency. Decode-sized passes therefore stay inline.
constexpr int64_t kParallelMinElems = 1 << 18;

std::string env_or(const char* name, const char* dflt) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : std::string(dflt);
}

int default_threads() {
  const std::string s = env_or("FGM_THREADS", "");
  if (!s.empty()) {
    char* end = nullptr;
    const long n = std::strtol(s.c_str(), &end, 10);
    if (*end || n < 1 || n > 1024) throw std::invalid_argument("FGM_THREADS must be a positive integer, got '" + s + "'");
    return int(n);
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// KV head g of a slot's K/V for one layer (src: the layer whose K/V it reads), as the attention kernels take it.
ops::AttnCache head_cache(const uint8_t* slot, const KvLayerLayout& src, KvDtype kvt, int hd, int g) {
  const bool scaled = kvt == KvDtype::Int8;
  return ops::AttnCache{slot + src.k_off, slot + src.v_off,
                        scaled ? reinterpret_cast<const float*>(slot + src.ks_off) : nullptr,
                        scaled ? reinterpret_cast<const float*>(slot + src.vs_off) : nullptr, src.row_bytes,
                        g * hd * kv_element_bytes(kvt), src.cap, kvt == KvDtype::F32};
}

}  // namespace

const char* phase_name(int p) {
  static const char* names[kNumPhases] = {"embed",       "ple",         "norms",     "act_quant",
                                          "qkv_gemm",    "qk_rope_kv",  "attention", "o_gemm",
                                          "ffn_gemm",    "ffn_act",     "ple_inject", "lm_head"};
  return (p >= 0 && p < kNumPhases) ? names[p] : "?";
}

WeightPolicy WeightPolicy::parse(const std::string& spec) {
  WeightPolicy p;
  if (spec == "int4") p.mode = Int4;
  else if (spec == "int8") p.mode = Int8;
  else if (spec.rfind("auto:", 0) == 0) {
    char* end = nullptr;
    const long m = std::strtol(spec.c_str() + 5, &end, 10);
    if (spec.size() == 5 || *end || m < 1 || m > (1 << 20))
      throw std::invalid_argument("weights policy '" + spec + "': auto:M needs a positive row count M");
    p.mode = Auto;
    p.min_rows = int(m);
  } else {
    throw std::invalid_argument("weights policy must be int4, int8 or auto:M, got '" + spec + "'");
  }
  return p;
}

std::string WeightPolicy::str() const {
  return mode == Int4 ? "int4" : mode == Int8 ? "int8" : "auto:" + std::to_string(min_rows);
}

void GatherTable::row(int r, float mult, float* out) const {
  if (dtype == DType::Q4R)
    ops::gather_q4r(codes + int64_t(r) * (cols / 2), static_cast<const uint16_t*>(scales) + int64_t(r) * (cols / 64),
                    cols, mult, out);
  else if (dtype == DType::Q8G)
    ops::gather_q8g(reinterpret_cast<const int8_t*>(codes) + int64_t(r / 16) * cols * 16, r % 16,
                    (Q8gScales{scales, scales_f16} + size_t(r)).p, scales_f16, offsets ? offsets + r : nullptr, rows,
                    group, cols, mult, out);
  else
    ops::gather_q8r(reinterpret_cast<const int8_t*>(codes) + int64_t(r) * cols, static_cast<const float*>(scales)[r],
                    cols, mult, out);
}

class Model::Timer {
 public:
  Timer(Model* m, int phase) : m_(m->profiling_ ? m : nullptr), phase_(phase) {
    if (m_) t0_ = std::chrono::steady_clock::now();
  }
  ~Timer() {
    if (!m_) return;
    m_->prof_ns_[phase_] +=
        uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count());
    ++m_->prof_calls_[phase_];
  }

 private:
  Model* m_;
  int phase_;
  std::chrono::steady_clock::time_point t0_;
};

Model::Model(std::shared_ptr<const FgmFile> file, const ModelOptions& opt) : file_(std::move(file)) {
  if (!ops::cpu_has_avx2_fma_f16c())
    throw std::runtime_error("the splitgemma engine needs a CPU with AVX2, FMA and F16C");
  if (opt.backend.empty()) {
    backend_ = active_backend();
  } else {
    backend_ = backend_from_name(opt.backend.c_str());
    if (!cpu_supports(backend_))
      throw std::runtime_error(std::string("the ") + backend_name(backend_) + " GEMM backend cannot run on this CPU");
  }
  // Prefill attention's int8 dot products on AMX tiles with the AMX backend (same bits as on zmm), unless the host
  // loses tile state (the guard then keeps AMX to the GEMMs).
  amx_attention_ = backend_ == Backend::Amx && amx_tiles_usable();
  // zmm element-wise kernels and quantiser where the backend's CPU has AVX-512 (FGM_BACKEND=avx2 keeps ymm).
  const bool zmm = backend_ != Backend::Avx2;
  ew_ = zmm ? &ops::elementwise_avx512() : &ops::elementwise_avx2();
  quantize_ = zmm ? quantize_activations_avx512 : static_cast<decltype(quantize_)>(quantize_activations);
  quantize_from_ = zmm ? quantize_activations_from_avx512 : quantize_activations_from;
  policy_ = WeightPolicy::parse(opt.weights.empty() ? env_or("FGM_WEIGHTS", "auto:16") : opt.weights);
  // q8g GEMMs on int8 activations by default: every backend multiplies int8 faster than f32 (VNNI, AMX: 4x; AVX2's
  // sign-trick kernel measured 1.2x the f32 kernel alone on Zen 3, ~10% of a 32-row step), at llama.cpp's fidelity.
  // f32 (weight-only, exact to the source: gemm.h) stays an option for fidelity checks.
  q8g_input_ = q8g_input_from_name(opt.q8g_input.empty() ? env_or("FGM_Q8G_INPUT", "int8") : opt.q8g_input);
  if (opt.max_context < 1) throw std::invalid_argument("max_context must be at least 1");
  if (opt.chunk < 1) throw std::invalid_argument("chunk must be at least 1");
  if (opt.max_batch < 1) throw std::invalid_argument("max_batch must be at least 1");
  if (opt.threads < 0) throw std::invalid_argument("threads must be positive (or 0/None for the default)");

  const ModelConfig& c = config();
  for (const LayerSpec& ls : c.layers)
    if (ls.head_dim % 8)
      throw FgmError(file_->path() + ": head dim " + std::to_string(ls.head_dim) +
                     " is not a multiple of 8 (the attention kernel reads 8 dims at a time)");

  chunk_ = std::min(opt.chunk, opt.max_context);
  max_rows_ = std::max(chunk_, opt.max_batch);
  const std::string& kv = !opt.kv_dtype.empty() ? opt.kv_dtype : c.kv_cache_dtype;
  layout_ = KvLayout(*file_, opt.max_context, chunk_, kv.empty() ? KvDtype::Int8 : kv_dtype_from_name(kv));
  pool_ = std::make_unique<ThreadPool>(opt.threads > 0 ? opt.threads : default_threads(), backend_thread_init);
  resolve_weights();

  // Scratch for max_rows_ rows.
  const int D = c.hidden_size, nh = c.num_heads, nkv = c.num_kv_heads, P = c.ple_dim, L = c.num_layers;
  int hd_max = 0, I_max = 0;
  for (const LayerSpec& ls : c.layers) hd_max = std::max(hd_max, ls.head_dim), I_max = std::max(I_max, ls.intermediate);
  const size_t R = size_t(max_rows_);
  h_.assign(R * D, 0.0f);
  x_.assign(R * D, 0.0f);
  tmp_.assign(R * D, 0.0f);
  q_.assign(R * nh * hd_max, 0.0f);
  attn_.assign(R * nh * hd_max, 0.0f);
  k_.assign(R * nkv * hd_max, 0.0f);
  v_.assign(R * nkv * hd_max, 0.0f);
  gate_.assign(R * I_max, 0.0f);
  up_.assign(R * I_max, 0.0f);
  if (P > 0) {
    ple_.assign(R * size_t(L) * P, 0.0f);
    pg_.assign(R * P, 0.0f);
  }
  rope_cs_[0].assign(R * c.global_head_dim, 0.0f);
  rope_cs_[1].assign(R * c.head_dim, 0.0f);
  rope_positions_ = std::min(opt.max_context, kRopeTablePositions);
  rope_table_[0].assign(size_t(rope_positions_) * c.global_head_dim, 0.0f);
  rope_table_[1].assign(size_t(rope_positions_) * c.head_dim, 0.0f);
  // Attention scores: one work item covers at most nh/nkv heads over at most max_context positions (ymm), or over
  // one part of the positions, plus a part's outputs (zmm).
  const size_t scores = std::max(size_t(nh / nkv) * size_t(opt.max_context),
                                 ops::attend_avx512_scratch_floats(nh / nkv, hd_max));
  // The prefill tile kernel (ops::attend_rows_avx512 / attend_rows_avx2): blocks of attend_vectors() / group rows.
  const int group = nh / nkv, block_rows = std::max(1, attend_vectors() / group);
  // The tile kernel also attends shared prefixes in decode (attend_prefixed): blocks of up to max_rows_ rows.
  const size_t tiles =
      ops::attend_rows_scratch_floats(std::min(block_rows, std::max(chunk_, max_rows_)) * group, hd_max);
  row_scratch_per_worker_ = (std::max({scores, size_t(L) * P, tiles}) + 15) & ~size_t(15);
  row_scratch_.assign(row_scratch_per_worker_ * pool_->size(), 0.0f);

  size_t packed = 0, rowsum = 0;
  for (int k : {D, nh * hd_max, I_max, std::max(P, 64)}) {
    packed = std::max(packed, qact_packed_bytes(max_rows_, k));
    rowsum = std::max(rowsum, qact_rowsum_count(max_rows_, k));
  }
  qa_packed_.assign(packed, 0);
  qa_scale_.assign(qact_padded_rows(max_rows_), 0.0f);
  qa_rowsum_.assign(rowsum, 0);
  qact_.packed = qa_packed_.data();
  qact_.scale = qa_scale_.data();
  qact_.rowsum = qa_rowsum_.data();
  rows_scratch_.resize(max_rows_);
  tok_scratch_.resize(max_rows_);

  const std::string prof = env_or("FGM_PROFILE", "0");
  profiling_ = prof != "0";
}

Model::~Model() = default;

int Model::attend_vectors() const { return amx_attention_ ? ops::kAttendRowsVectorsAmx : ops::kAttendRowsVectors; }

DualLinear Model::dual(const std::string& name) const {
  DualLinear d;
  d.w = qlinear_from(*file_, file_->require(name));
  if (const TensorInfo* t = file_->find(name + ".i8")) d.i8 = qlinear_from(*file_, *t);
  return d;
}

void Model::set_weight_policy(const std::string& spec) {
  const WeightPolicy p = WeightPolicy::parse(spec);
  std::lock_guard<std::mutex> lock(run_mu_);  // not while a pass reads it
  policy_ = p;
}

void Model::resolve_weights() {
  const ModelConfig& c = config();
  auto f32 = [&](const std::string& name) {
    const TensorInfo& t = file_->require(name);
    if (t.dtype != DType::F32) throw FgmError(file_->path() + ": tensor '" + name + "' must be f32");
    return reinterpret_cast<const float*>(t.data);
  };
  auto table = [&](const std::string& name) {
    const TensorInfo& t = file_->require(name);
    GatherTable g;
    g.dtype = is_paneled(t.dtype) ? DType::Q8G : t.dtype;  // q8ga: q8g with offsets
    if (t.dtype == DType::Q8GA) g.offsets = reinterpret_cast<const float*>(file_->require(name + ".offset").data);
    g.rows = int(t.rows());
    g.cols = int(t.cols());
    g.group = t.group;
    g.codes = t.data;
    const TensorInfo& s = file_->require(name + ".scale");
    g.scales = s.data;
    g.scales_f16 = is_paneled(t.dtype) && s.dtype == DType::F16;
    return g;
  };
  embed_ = table("embed_tokens");
  // Without an lm_head tensor the reader has checked that embed_tokens is q8g/q8ga: the tied table is the head.
  if (file_->find("lm_head")) lm_head_ = dual("lm_head");
  else lm_head_.w = qlinear_from(*file_, file_->require("embed_tokens"));
  final_norm_ = f32("norm");
  if (c.ple_dim > 0) {
    ple_table_ = table("embed_tokens_per_layer");
    ple_model_proj_ = dual("per_layer_model_projection");
    ple_proj_norm_ = f32("per_layer_projection_norm");
    // Rows [0, fs*P) of a q8c weight are a prefix of its bytes (16-row blocks are stored one after the other, each
    // walking K) and of its f32 scales; q4g scales are [K/G][N], so no prefix view there.
    const QLinear& w = ple_model_proj_.w;
    const int head_rows = c.first_shared_layer * c.ple_dim;
    if (w.dtype == DType::Q8C && !ple_model_proj_.i8.codes && head_rows % 16 == 0 && head_rows < w.n) {
      ple_proj_head_.w = w;
      ple_proj_head_.w.n = head_rows;
    }
  }
  if (file_->find("rope.full_attention.inv_freq")) inv_freq_[0] = f32("rope.full_attention.inv_freq");
  if (file_->find("rope.sliding_attention.inv_freq")) inv_freq_[1] = f32("rope.sliding_attention.inv_freq");
  layers_.resize(c.num_layers);
  q_norm_scaled_.assign(c.num_layers, {});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "l" + std::to_string(i) + ".";
    LayerWeights& w = layers_[i];
    w.input_ln = f32(p + "input_layernorm");
    w.post_attn_ln = f32(p + "post_attention_layernorm");
    w.pre_ffn_ln = f32(p + "pre_feedforward_layernorm");
    w.post_ffn_ln = f32(p + "post_feedforward_layernorm");
    if (c.use_layer_scalar) w.layer_scalar = f32(p + "layer_scalar")[0];
    w.q_norm = f32(p + "q_norm");
    if (c.attention_scale != 1.0) {
      // q is RMS-normed, weighted and rotated, all linear after the norm: the attention scale folds into the
      // q_norm weight once here instead of scaling every score.
      const int hd = c.layers[i].head_dim;
      std::vector<float>& scaled = q_norm_scaled_[i];
      scaled.resize(hd);
      for (int d = 0; d < hd; ++d) scaled[d] = float(double(w.q_norm[d]) * c.attention_scale);
      w.q_norm = scaled.data();
    }
    w.q = dual(p + "q_proj");
    w.o = dual(p + "o_proj");
    if (c.layers[i].owns_kv) {
      w.k_norm = f32(p + "k_norm");
      w.k = dual(p + "k_proj");
      w.v = dual(p + "v_proj");
    }
    w.gate = dual(p + "gate_proj");
    w.up = dual(p + "up_proj");
    w.down = dual(p + "down_proj");
    if (c.ple_dim > 0) {
      w.post_ple_ln = f32(p + "post_per_layer_input_norm");
      w.ple_gate = dual(p + "per_layer_input_gate");
      w.ple_proj = dual(p + "per_layer_projection");
    }
  }
}

template <class F>
void Model::for_rows(int m, int64_t work_per_row, F&& f) {
  if (m > 1 && pool_->size() > 1 && int64_t(m) * work_per_row >= kParallelMinElems)
    pool_->parallel_for(m, [&](int r, int w) { f(r, w); });
  else
    for (int r = 0; r < m; ++r) f(r, 0);
}

namespace {

// A RowSource calling f(r, row).
template <class F>
RowSource row_source(const F& f) {
  return RowSource{[](const void* ctx, int r, float* row) { (*static_cast<const F*>(ctx))(r, row); }, &f};
}

}  // namespace

void Model::gelu_row(const float* g, const float* u, int n, float* row) const {
  if (row != g) std::memcpy(row, g, sizeof(float) * n);
  ew_->gelu_mul(row, u, n);
}

void Model::gemm_group(float* x, int ldx, int m, int k, std::initializer_list<GemmOut> outs, int phase,
                       const RowPrep* prep) {
  // The GEMMs that share an input go out in one dispatch each kind: the int8-activation ones on one quantised x
  // (gemm_multi), the q8g ones on x itself (gemm_q8g_multi, which quantises it its own way for int8 input), which a
  // row preparation fills first.
  if (prep) {
    bool fused = k <= kRowSourceMaxK;
    for (const GemmOut& o : outs) fused &= o.w->pick(shape_rows(m), policy_).dtype != DType::Q8G;
    if (!fused) {
      Timer t(this, prep->phase);
      for_rows(m, k, [&](int r, int) { prep->src.fill(prep->src.ctx, r, x + size_t(r) * ldx); });
      prep = nullptr;
    }
  }
  GemmTarget batch[4], q8g[4];
  int n = 0, n_q8g = 0, quantised_for = -1;  // the Hadamard setting qact_ currently holds x for
  auto flush = [&] {
    if (!n) return;
    Timer t(this, phase);
    gemm_multi(qact_, batch, n, pool_.get(), backend_);
    n = 0;
  };
  auto flush_q8g = [&] {
    if (!n_q8g) return;
    Timer t(this, phase);
    gemm_q8g_multi(x, ldx, m, q8g, n_q8g, pool_.get(), backend_, q8g_input_);
    n_q8g = 0;
  };
  for (const GemmOut& o : outs) {
    const QLinear& w = o.w->pick(shape_rows(m), policy_);
    const int ldy = o.ldy ? o.ldy : w.n;
    if (w.dtype == DType::Q8G) {
      if (n_q8g == 4) flush_q8g();
      q8g[n_q8g++] = GemmTarget{&w, o.y, ldy};
      continue;
    }
    if (w.hadamard != quantised_for || n == 4) {
      flush();
      if (w.hadamard != quantised_for) {
        Timer t(this, kActQuant);
        if (prep) quantize_from_(prep->src, m, k, w.hadamard, &qact_, pool_.get());
        else quantize_(x, ldx, m, k, w.hadamard, &qact_, pool_.get());
        quantised_for = w.hadamard;
      }
    }
    batch[n++] = GemmTarget{&w, o.y, ldy};
  }
  flush();
  flush_q8g();
}

void Model::embed(const int32_t* tokens, int m, int full_from) {
  const ModelConfig& c = config();
  const int D = c.hidden_size, P = c.ple_dim, LP = c.num_layers * c.ple_dim, fs = c.first_shared_layer;
  {
    Timer t(this, kEmbed);
    const float es = float(c.embed_scale);
    for_rows(m, D, [&](int r, int) { embed_.row(tokens[r], es, &h_[size_t(r) * D]); });
  }
  if (P == 0) return;
  // Per-layer inputs (spec §3.1): project the scaled embedding, scale, RMSNorm each P-chunk, add the scaled
  // per-layer table row, scale by 2^-1/2.
  if (full_from > 0 && ple_proj_head_.w.codes) {
    gemm_group(h_.data(), D, full_from, D, {{&ple_proj_head_, ple_.data(), LP}}, kPle);
    if (full_from < m)
      gemm_group(&h_[size_t(full_from) * D], D, m - full_from, D, {{&ple_model_proj_, &ple_[size_t(full_from) * LP]}},
                 kPle);
  } else {
    gemm_group(h_.data(), D, m, D, {{&ple_model_proj_, ple_.data()}}, kPle);
  }
  Timer t(this, kPle);
  const float proj_scale = float(c.ple_model_projection_scale), tok_scale = float(c.ple_embed_scale),
              in_scale = float(c.ple_input_scale), eps = float(c.rms_norm_eps);
  for_rows(m, LP, [&](int r, int w) {
    float* g = &row_scratch_[size_t(w) * row_scratch_per_worker_];
    // GDM maps ids outside the per-layer vocabulary to 0 (only matters when it is smaller than the vocabulary).
    ple_table_.row(tokens[r] < ple_table_.rows ? tokens[r] : 0, tok_scale, g);
    float* row = &ple_[size_t(r) * LP];
    const int layers = r >= full_from ? c.num_layers : fs;
    for (int l = 0; l < layers; ++l)
      ew_->ple_mix(row + l * P, g + l * P, ple_proj_norm_, P, proj_scale, in_scale, eps);
  });
}

void Model::compute_rope(int m, const RowCtx* rows) {
  Timer timer(this, kQkRopeKv);
  const ModelConfig& c = config();
  for (int t = 0; t < 2; ++t) {
    if (!inv_freq_[t]) continue;
    const int hd = t == 0 ? c.global_head_dim : c.head_dim, half = hd / 2;
    const float* f = inv_freq_[t];
    auto angles = [&](int pos, float* cs) {
      for (int d = 0; d < half; ++d) {
        // The angle in double: at position 1e5 a float product would already be off by ~0.004 rad.
        const double a = double(pos) * double(f[d]);
        cs[d] = float(std::cos(a));
        cs[half + d] = float(std::sin(a));
      }
    };
    // Positions below rope_positions_ come from the table, filled up to the largest position asked for so far (the
    // libm cos/sin of a row cost ~10 us, a decode step at B = 32 would spend ~0.4 ms on them).
    int need = 0;
    for (int r = 0; r < m; ++r) need = std::max(need, std::min(rows[r].pos + 1, rope_positions_));
    if (need > rope_filled_[t]) {
      const int p0 = rope_filled_[t];
      for_rows(need - p0, 8 * hd, [&](int i, int) { angles(p0 + i, &rope_table_[t][size_t(p0 + i) * hd]); });
      rope_filled_[t] = need;
    }
    for (int r = 0; r < m; ++r) {
      float* cs = &rope_cs_[t][size_t(r) * hd];
      if (rows[r].pos < rope_positions_) std::memcpy(cs, &rope_table_[t][size_t(rows[r].pos) * hd], sizeof(float) * hd);
      else angles(rows[r].pos, cs);
    }
  }
}

bool Model::tile_kernel_runs(int group, int head_dim, const KvLayerLayout& src) const {
  return head_dim % 32 == 0 && group <= ops::kAttendRowsVectors &&
         int64_t(src.cap) * src.row_bytes < (int64_t(1) << 31);
}

void Model::attend_spans(const ops::AttnSpanRow* rows, int n, int group, int head_dim, const ops::AttnCache& c,
                         float* scratch) const {
  // zmm (AVX-512 VNNI, which the vnni and amx backends imply; AMX tiles for int8 and f16 where they hold) or ymm.
  if (backend_ == Backend::Avx2) ops::attend_spans_avx2(rows, n, group, head_dim, c, scratch);
  else ops::attend_spans_avx512(rows, n, group, head_dim, c, scratch, amx_attention_);
}

bool Model::attend_rows_ok(int m, const RowCtx* rows, int group, int head_dim, const KvLayerLayout& src) const {
  // Prefill only (shape_rows_ == 0), every pass of it (one row too): a row's result then does not depend on how the
  // prompt was split into calls and chunks (prefix reuse equals a whole prefill). A multi-token decode run keeps
  // attend()'s per-token results, which equal those of a plain decode.
  if (shape_rows_ != 0 || !tile_kernel_runs(group, head_dim, src)) return false;
  for (int r = 1; r < m; ++r)
    if (rows[r].slot != rows[0].slot || rows[r].pos != rows[0].pos + r) return false;
  return true;
}

void Model::attend_prefixed(int m, const RowCtx* rows, int l, const float* q, float* attn) {
  const ModelConfig& c = config();
  const LayerSpec& ls = c.layers[l];
  const KvLayerLayout& src = layout_.layer(ls.kv_source);
  const int nh = c.num_heads, nkv = c.num_kv_heads, group = nh / nkv, hd = ls.head_dim, qw = nh * hd;
  const KvDtype kvt = layout_.dtype();
  const int rot = kvt != KvDtype::Int8 ? 1 : ops::kv_rotation_block(hd);
  constexpr int P = ops::kAttendPartPositions;
  // The tile kernel where it runs; else attend_part (ymm) of the prefix and of the rest.
  const bool tiles = tile_kernel_runs(group, hd, src), zmm = backend_ != Backend::Avx2;
  const auto cache_of = [&](const uint8_t* s, int g) { return head_cache(s, src, kvt, hd, g); };

  // Each row's parts: its prefix positions [lo, prefix_len) (on the tile path, the absolute parts of P positions
  // they meet: a row's arithmetic does not depend on the rows beside it) and its own [own, pos].
  prefix_spans_.resize(m);
  prefix_rows_.clear();
  int max_parts = 1;
  for (int r = 0; r < m; ++r) {
    PrefixSpan& sp = prefix_spans_[r];
    const int pos = rows[r].pos, pl = rows[r].prefix ? rows[r].prefix_len : 0;
    sp.lo = ls.sliding ? std::max(0, pos - c.sliding_window + 1) : 0;
    sp.own = std::max(sp.lo, pl);
    sp.part0 = sp.lo / P;
    sp.parts = sp.lo >= pl ? 0 : tiles ? (pl - 1) / P - sp.part0 + 1 : 1;
    sp.own_parts = tiles ? ops::attend_parts(pos - sp.own + 1) : 1;
    max_parts = std::max(max_parts, sp.parts + sp.own_parts);
    if (sp.parts) prefix_rows_.push_back(r);
  }
  const size_t part_floats = size_t(group) * hd, item_floats = max_parts * (part_floats + 2 * group);
  if (attn_parts_.size() < size_t(m) * nkv * item_floats) attn_parts_.resize(size_t(m) * nkv * item_floats);
  // Per (row, KV head): the parts' outputs (group x hd floats each), then their stats (group x 2).
  const auto part_out = [&](int r, int g, int k) {
    return &attn_parts_[(size_t(r) * nkv + g) * item_floats + k * part_floats];
  };
  const auto part_stats = [&](int r, int g, int k) {
    return &attn_parts_[(size_t(r) * nkv + g) * item_floats + max_parts * part_floats + k * 2 * group];
  };
  float* const scratch = row_scratch_.data();
  const auto worker_scratch = [&](int w) { return scratch + size_t(w) * row_scratch_per_worker_; };

  if (!tiles) {
    pool_->parallel_for(m * nkv, [&](int it, int w) {
      const int r = it / nkv, g = it % nkv;
      const PrefixSpan& sp = prefix_spans_[r];
      const float* qr = q + size_t(r) * qw + size_t(g) * part_floats;
      if (sp.parts)
        ops::attend_part(qr, hd, group, hd, cache_of(rows[r].prefix, g), sp.lo, rows[r].prefix_len - 1,
                         part_out(r, g, 0), hd, worker_scratch(w), part_stats(r, g, 0));
      ops::attend_part(qr, hd, group, hd, cache_of(rows[r].slot, g), sp.own, rows[r].pos, part_out(r, g, sp.parts),
                       hd, worker_scratch(w), part_stats(r, g, sp.parts));
      float* out = attn + size_t(r) * qw + size_t(g) * part_floats;
      ops::attend_merge_parts_ymm(part_out(r, g, 0), part_stats(r, g, 0), sp.parts + 1, group, hd, out, hd);
      ew_->fwht_blocks(out, group * hd, rot);
    });
    return;
  }

  // The prefix work: the rows naming one prefix in blocks of R (as many query vectors as a prefill block), per KV
  // head and prefix part. The blocks' rows are grouped by prefix first.
  std::stable_sort(prefix_rows_.begin(), prefix_rows_.end(), [&](int a, int b) {
    return std::make_pair(rows[a].prefix, rows[a].prefix_len) < std::make_pair(rows[b].prefix, rows[b].prefix_len);
  });
  prefix_items_.clear();
  const int R = std::max(1, attend_vectors() / group), n_prefixed = int(prefix_rows_.size());
  for (int i = 0; i < n_prefixed;) {
    int j = i + 1;
    while (j < n_prefixed && j - i < R && rows[prefix_rows_[j]].prefix == rows[prefix_rows_[i]].prefix &&
           rows[prefix_rows_[j]].prefix_len == rows[prefix_rows_[i]].prefix_len)
      ++j;
    int first_part = INT32_MAX;
    for (int k = i; k < j; ++k) first_part = std::min(first_part, prefix_spans_[prefix_rows_[k]].part0);
    const int last_part = (rows[prefix_rows_[i]].prefix_len - 1) / P;
    for (int g = 0; g < nkv; ++g)
      for (int part = last_part; part >= first_part; --part) prefix_items_.push_back(PrefixItem{i, j - i, g, part});
    i = j;
  }
  const int n_prefix_items = int(prefix_items_.size()), own_items = m * nkv * max_parts;
  pool_->parallel_for(n_prefix_items + own_items, [&](int it, int w) {
    if (it < n_prefix_items) {
      const PrefixItem& item = prefix_items_[it];
      ops::AttnSpanRow block[ops::kAttendRowsVectorsAmx];
      int n = 0;
      const uint8_t* prefix = nullptr;
      for (int k = item.first; k < item.first + item.count; ++k) {
        const int r = prefix_rows_[k];
        const PrefixSpan& sp = prefix_spans_[r];
        if (item.part < sp.part0) continue;  // the row's window starts after this part
        prefix = rows[r].prefix;
        const int slot = item.part - sp.part0;
        block[n++] = ops::AttnSpanRow{q + size_t(r) * qw + size_t(item.head) * part_floats,
                                      part_out(r, item.head, slot), part_stats(r, item.head, slot),
                                      std::max(sp.lo, item.part * P),
                                      std::min((item.part + 1) * P, rows[r].prefix_len) - 1};
      }
      if (n) attend_spans(block, n, group, hd, cache_of(prefix, item.head), worker_scratch(w));
      return;
    }
    it -= n_prefix_items;
    const int r = it / (nkv * max_parts), g = (it / max_parts) % nkv, p = it % max_parts;
    const PrefixSpan& sp = prefix_spans_[r];
    if (p >= sp.own_parts) return;
    const int span = rows[r].pos - sp.own + 1;
    (zmm ? ops::attend_avx512_part : ops::attend_part)(
        q + size_t(r) * qw + size_t(g) * part_floats, hd, group, hd, cache_of(rows[r].slot, g),
        ops::attend_part_start(sp.own, span, p), ops::attend_part_start(sp.own, span, p + 1) - 1,
        part_out(r, g, sp.parts + p), hd, worker_scratch(w), part_stats(r, g, sp.parts + p));
  });
  pool_->parallel_for(m * nkv, [&](int it, int) {
    const int r = it / nkv, g = it % nkv;
    const PrefixSpan& sp = prefix_spans_[r];
    float* out = attn + size_t(r) * qw + size_t(g) * part_floats;
    (zmm ? ops::attend_merge_parts_avx512 : ops::attend_merge_parts_ymm)(
        part_out(r, g, 0), part_stats(r, g, 0), sp.parts + sp.own_parts, group, hd, out, hd);
    ew_->fwht_blocks(out, group * hd, rot);
  });
}

void Model::run_layers(int l0, int l1, int m, const RowCtx* rows) {
  const ModelConfig& c = config();
  const int D = c.hidden_size, nh = c.num_heads, nkv = c.num_kv_heads, P = c.ple_dim, LP = c.num_layers * c.ple_dim;
  const int group = nh / nkv;
  const float eps = float(c.rms_norm_eps);
  float *h = h_.data(), *x = x_.data(), *q = q_.data(), *k = k_.data(), *v = v_.data(), *attn = attn_.data(),
        *tmp = tmp_.data(), *gate = gate_.data(), *up = up_.data(), *ple = ple_.data(), *pg = pg_.data();

  for (int l = l0; l < l1; ++l) {
    const LayerSpec& ls = c.layers[l];
    const LayerWeights& W = layers_[l];
    const int hd = ls.head_dim, qw = nh * hd, kvw = nkv * hd, I = ls.intermediate;
    const KvDtype kvt = layout_.dtype();
    const bool float_kv = kvt != KvDtype::Int8;
    const int rot = float_kv ? 1 : ops::kv_rotation_block(hd);  // f16/f32 have no scale to share: nothing to spread
    const float* rope_cs = rope_cs_[ls.sliding ? 1 : 0].data();

    // --- attention ---
    const auto input_norm = [&](int r, float* row) { ew_->rmsnorm(h + size_t(r) * D, W.input_ln, row, D, eps); };
    const RowPrep input_prep{row_source(input_norm), kNorms};
    if (ls.owns_kv)
      gemm_group(x, D, m, D, {{&W.q, q}, {&W.k, k}, {&W.v, v}}, kQkvGemm, &input_prep);
    else
      gemm_group(x, D, m, D, {{&W.q, q}}, kQkvGemm, &input_prep);
    {
      Timer t(this, kQkRopeKv);
      const KvLayerLayout& kl = layout_.layer(l);
      for_rows(m, qw + 2 * kvw, [&](int r, int) {
        const float* cs = rope_cs + size_t(r) * hd;
        // q, k and v are rotated per head by the orthonormal Hadamard H (kv_layout.h): q·k is unchanged, the int8
        // codes of k and v see their energy spread over the block, and attend()'s output is rotated back below.
        for (int hh = 0; hh < nh; ++hh) {
          ew_->head_norm_rope(q + size_t(r) * qw + size_t(hh) * hd, W.q_norm, hd, cs, rot, eps);
        }
        if (!ls.owns_kv) return;
        float* kr = k + size_t(r) * kvw;
        float* vr = v + size_t(r) * kvw;
        for (int g = 0; g < nkv; ++g) {
          // K's rotation per head equals the rotation of the whole row: blocks never straddle heads (rot | hd).
          ew_->head_norm_rope(kr + g * hd, W.k_norm, hd, cs, rot, eps);
          if (c.use_v_norm) ew_->rmsnorm(vr + g * hd, nullptr, vr + g * hd, hd, eps);
        }
        ew_->fwht_blocks(vr, kvw, rot);
        uint8_t* s = rows[r].slot;
        const int64_t row = rows[r].pos % kl.cap;
        if (kvt == KvDtype::F32) {
          std::memcpy(reinterpret_cast<float*>(s + kl.k_off) + row * kvw, kr, sizeof(float) * kvw);
          std::memcpy(reinterpret_cast<float*>(s + kl.v_off) + row * kvw, vr, sizeof(float) * kvw);
        } else if (kvt == KvDtype::F16) {
          ew_->store_row_f16(kr, kvw, reinterpret_cast<uint16_t*>(s + kl.k_off) + row * kvw);
          ew_->store_row_f16(vr, kvw, reinterpret_cast<uint16_t*>(s + kl.v_off) + row * kvw);
        } else {
          ew_->quantize_row_i8(kr, kvw, reinterpret_cast<int8_t*>(s + kl.k_off) + row * kvw,
                               reinterpret_cast<float*>(s + kl.ks_off) + row);
          ew_->quantize_row_i8(vr, kvw, reinterpret_cast<int8_t*>(s + kl.v_off) + row * kvw,
                               reinterpret_cast<float*>(s + kl.vs_off) + row);
        }
      });
    }
    {
      Timer t(this, kAttention);
      const KvLayerLayout& src = layout_.layer(ls.kv_source);
      const bool zmm = backend_ != Backend::Avx2;
      // Work items: (row, KV head, block of query heads). When rows x KV heads would leave threads idle (decode),
      // the parts of each row's positions (ops::attend_parts: fixed by the span, so the bits are a whole
      // attend_avx512's, or attend's on avx2) go to different threads, each part read once for all the group's
      // heads, and are merged after; then, or for spans of one part, the group's heads are split (each split
      // re-reads the K/V). Both follow shape_rows, so a token of a multi-token decode run is attended as a plain
      // decode would.
      const int base_items = m * nkv, shape_items = shape_rows(m) * nkv;
      const int window = c.sliding_window;
      const auto span_of = [&](int r, int* lo) {
        *lo = ls.sliding ? std::max(0, rows[r].pos - window + 1) : 0;
        return rows[r].pos - *lo + 1;
      };
      int parts = 1;
      if (shape_items < pool_->size() && hd % 16 == 0)
        for (int r = 0, lo; r < m; ++r) parts = std::max(parts, ops::attend_parts(span_of(r, &lo)));
      int per = group;
      if (shape_items * parts < pool_->size())
        per = std::max(1, (group * shape_items * parts + pool_->size() - 1) / pool_->size());
      const int nch = (group + per - 1) / per;
      const auto cache_of = [&](const uint8_t* s, int g) { return head_cache(s, src, kvt, hd, g); };
      bool prefixed = false;
      for (int r = 0; r < m; ++r) prefixed |= rows[r].prefix != nullptr;
      if (prefixed) {
        attend_prefixed(m, rows, l, q, attn);
      } else if (attend_rows_ok(m, rows, group, hd, src)) {
        // Prefill: blocks of R consecutive rows x one KV head's query heads, each K/V tile read once per block
        // (ops::attend_rows_avx512, or attend_rows_avx2 on the avx2 backend). The last blocks attend the most
        // positions: they are handed out first.
        const int R = std::max(1, attend_vectors() / group), nb = (m + R - 1) / R;
        pool_->parallel_for(nb * nkv, [&](int it, int w) {
          it = nb * nkv - 1 - it;
          const int r0 = (it / nkv) * R, g = it % nkv, nr = std::min(R, m - r0);
          const size_t at = size_t(r0) * qw + size_t(g) * group * hd;
          const ops::AttnCache cache = cache_of(rows[r0].slot, g);
          float* const scratch = &row_scratch_[size_t(w) * row_scratch_per_worker_];
          if (backend_ == Backend::Avx2)
            ops::attend_rows_avx2(q + at, qw, nr, group, hd, cache, rows[r0].pos, ls.sliding ? window : 0, attn + at,
                                  qw, scratch);
          else
            ops::attend_rows_avx512(q + at, qw, nr, group, hd, cache, rows[r0].pos, ls.sliding ? window : 0,
                                    attn + at, qw, scratch, amx_attention_);
          for (int r = 0; r < nr; ++r) ew_->fwht_blocks(attn + at + size_t(r) * qw, group * hd, rot);
        });
      } else if (parts > 1) {
        // attn_parts_: per (row, KV head), each part's outputs (group x hd), then each part's stats (group x 2).
        const size_t part_floats = size_t(group) * hd, item_floats = parts * (part_floats + 2 * group);
        if (attn_parts_.size() < base_items * item_floats) attn_parts_.resize(base_items * item_floats);
        pool_->parallel_for(base_items * nch * parts, [&](int it, int w) {
          const int item = it / (nch * parts), hc = (it / parts) % nch, p = it % parts, r = item / nkv, g = item % nkv;
          int lo;
          const int span = span_of(r, &lo);
          if (p >= ops::attend_parts(span)) return;
          const int h0 = hc * per, nq = std::min(per, group - h0);
          float* at = &attn_parts_[item * item_floats];
          (zmm ? ops::attend_avx512_part : ops::attend_part)(
              q + size_t(r) * qw + size_t(g) * part_floats + size_t(h0) * hd, hd, nq, hd, cache_of(rows[r].slot, g),
              ops::attend_part_start(lo, span, p), ops::attend_part_start(lo, span, p + 1) - 1,
              at + p * part_floats + h0 * hd, hd, &row_scratch_[size_t(w) * row_scratch_per_worker_],
              at + parts * part_floats + (p * group + h0) * 2);
        });
        for (int item = 0, lo; item < base_items; ++item) {
          const int r = item / nkv, g = item % nkv;
          const float* at = &attn_parts_[item * item_floats];
          float* out = attn + size_t(r) * qw + size_t(g) * part_floats;
          (zmm ? ops::attend_merge_parts_avx512 : ops::attend_merge_parts_ymm)(
              at, at + parts * part_floats, ops::attend_parts(span_of(r, &lo)), group, hd, out, hd);
          ew_->fwht_blocks(out, group * hd, rot);
        }
      } else {
        // zmm attention on the backends whose CPUs have AVX-512 (FGM_BACKEND=avx2 keeps the ymm code).
        const auto attend = zmm ? ops::attend_avx512 : ops::attend;
        pool_->parallel_for(base_items * nch, [&](int it, int w) {
          const int r = it / (nkv * nch), g = (it / nch) % nkv, hc = it % nch;
          const int h0 = g * group + hc * per, nq = std::min(per, group - hc * per);
          const int pos = rows[r].pos, lo = ls.sliding ? std::max(0, pos - window + 1) : 0;
          float* out = attn + size_t(r) * qw + size_t(h0) * hd;
          attend(q + size_t(r) * qw + size_t(h0) * hd, hd, nq, hd, cache_of(rows[r].slot, g), lo, pos, out, hd,
                 &row_scratch_[size_t(w) * row_scratch_per_worker_]);
          ew_->fwht_blocks(out, nq * hd, rot);  // Σ p·(vH) = (Σ p·v)H; H is its own inverse
        });
      }
    }
    gemm_group(attn, qw, m, qw, {{&W.o, tmp}}, kOGemm);
    {
      Timer t(this, kNorms);
      for_rows(m, D, [&](int r, int) {
        ew_->add_rmsnorm(h + size_t(r) * D, tmp + size_t(r) * D, W.post_attn_ln, D, eps);
      });
    }

    // --- MLP ---
    const auto ffn_norm = [&](int r, float* row) { ew_->rmsnorm(h + size_t(r) * D, W.pre_ffn_ln, row, D, eps); };
    const RowPrep ffn_prep{row_source(ffn_norm), kNorms};
    gemm_group(x, D, m, D, {{&W.gate, gate}, {&W.up, up}}, kFfnGemm, &ffn_prep);
    const auto ffn_act = [&](int r, float* row) { gelu_row(gate + size_t(r) * I, up + size_t(r) * I, I, row); };
    const RowPrep act_prep{row_source(ffn_act), kFfnAct};
    gemm_group(gate, I, m, I, {{&W.down, tmp}}, kFfnGemm, &act_prep);
    {
      Timer t(this, kNorms);
      for_rows(m, D, [&](int r, int) { ew_->add_rmsnorm(h + size_t(r) * D, tmp + size_t(r) * D, W.post_ffn_ln, D, eps); });
    }

    // --- per-layer input, then the layer scalar ---
    if (P > 0) {
      gemm_group(h, D, m, D, {{&W.ple_gate, pg}}, kPleInject);
      const auto ple_act = [&](int r, float* row) {
        gelu_row(pg + size_t(r) * P, ple + size_t(r) * LP + size_t(l) * P, P, row);
      };
      const RowPrep ple_prep{row_source(ple_act), kPleInject};
      gemm_group(pg, P, m, P, {{&W.ple_proj, tmp}}, kPleInject, &ple_prep);
    }
    if (P == 0 && W.layer_scalar == 1.0f) continue;
    Timer t(this, kNorms);
    for_rows(m, D, [&](int r, int) {
      float* hr = h + size_t(r) * D;
      if (P > 0) ew_->add_rmsnorm(hr, tmp + size_t(r) * D, W.post_ple_ln, D, eps);
      if (W.layer_scalar != 1.0f) ew_->scale(hr, D, W.layer_scalar);
    });
  }
}

void Model::lm_head(int m, float* out) {
  const ModelConfig& c = config();
  const int D = c.hidden_size, V = c.vocab_size;
  const auto final_norm = [&](int r, float* row) {
    ew_->rmsnorm(&h_[size_t(r) * D], final_norm_, row, D, float(c.rms_norm_eps));
  };
  const RowPrep prep{row_source(final_norm), kNorms};
  gemm_group(x_.data(), D, m, D, {{&lm_head_, out}}, kLmHead, &prep);
  if (c.final_softcap > 0) {
    Timer t(this, kLmHead);
    const float cap = float(c.final_softcap);
    for_rows(m, V, [&](int r, int) { ew_->softcap(out + size_t(r) * V, V, cap); });
  }
}

void Model::sample_rows(const SampleRow* rows, int n, RowOutcome* out) {
  std::lock_guard<std::mutex> lk(run_mu_);
  sg::sample_rows(rows, n, out, pool_.get());
}

void Model::check_arena(const KvArena& arena) const {
  const KvLayout& a = arena.layout();
  if (a.model_signature() != layout_.model_signature())
    throw std::invalid_argument("the KV arena was laid out for a different model file (layout signature mismatch)");
  if (!a.same_as(layout_))
    throw std::invalid_argument("the KV arena was laid out with a different slot geometry (max_context " +
                                std::to_string(a.max_context()) + ", chunk " + std::to_string(a.chunk()) +
                                "; this model: " + std::to_string(layout_.max_context()) + ", " +
                                std::to_string(layout_.chunk()) + ")");
}

void Model::check_token(int token, const char* what, int index) const {
  if (token < 0 || token >= config().vocab_size)
    throw std::out_of_range(std::string(what) + "[" + std::to_string(index) + "] = " + std::to_string(token) +
                            " is not a token id in [0, " + std::to_string(config().vocab_size) + ")");
}

void Model::check_prefill(const KvArena& arena, int slot, const int32_t* tokens, int T, int pos0) const {
  check_arena(arena);
  arena.check_slot(slot);
  if (T < 1) throw std::invalid_argument("prefill needs at least one token");
  for (int i = 0; i < T; ++i) check_token(tokens[i], "tokens", i);
  arena.check_write(slot, pos0, T);
}

void Model::prefill(KvArena& arena, int slot, const int32_t* tokens, int T, int pos0, bool all_logits, float* out) {
  std::lock_guard<std::mutex> lock(run_mu_);  // also orders validation with the writes of a concurrent call
  check_prefill(arena, slot, tokens, T, pos0);

  backend_thread_init();
  const ModelConfig& c = config();
  const int D = c.hidden_size, V = c.vocab_size, LP = c.num_layers * c.ple_dim, fs = c.first_shared_layer,
            L = c.num_layers;
  uint8_t* base = arena.slot(slot);
  // Positions from pos0 on are being rewritten: until done, the slot claims only what precedes them.
  arena.mark_written(slot, uint32_t(pos0));
  RowCtx* rows = rows_scratch_.data();
  for (int c0 = 0; c0 < T; c0 += chunk_) {
    const int m = std::min(chunk_, T - c0);
    for (int r = 0; r < m; ++r) rows[r] = RowCtx{base, pos0 + c0 + r};
    // The shared layers' per-layer inputs only for the row(s) that go through those layers (below).
    embed(tokens + c0, m, all_logits ? 0 : (c0 + m < T ? m : m - 1));
    compute_rope(m, rows);
    if (all_logits) {
      run_layers(0, L, m, rows);
      lm_head(m, out + size_t(c0) * V);
      continue;
    }
    // Spec §3.5: layers >= first_shared_layer write no K/V, so only the rows whose logits are wanted (here the
    // prompt's last row) go through them.
    run_layers(0, fs, m, rows);
    if (c0 + m < T) continue;
    if (m > 1) {
      std::memcpy(&h_[0], &h_[size_t(m - 1) * D], sizeof(float) * D);
      if (LP) std::memcpy(&ple_[0], &ple_[size_t(m - 1) * LP], sizeof(float) * LP);
      rows[0] = rows[m - 1];
      compute_rope(1, rows);
    }
    run_layers(fs, L, 1, rows);
    lm_head(1, out);
  }
  arena.mark_written(slot, uint32_t(pos0 + T));
}

int Model::check_decode(const KvArena& arena, const DecodeRow* in, int n) const {
  check_arena(arena);
  if (n < 1) throw std::invalid_argument("decode needs at least one sequence");
  std::vector<int> slots;
  int wanted = 0;
  for (int i = 0; i < n;) {
    int j = i + 1;
    for (; j < n && in[j].slot == in[i].slot; ++j)
      if (in[j].pos != in[j - 1].pos + 1)
        throw std::invalid_argument("decode: slot " + std::to_string(in[i].slot) +
                                    " appears twice in one batch, which only a run at consecutive positions may (entry " +
                                    std::to_string(j) + " is at " + std::to_string(in[j].pos) + " after " +
                                    std::to_string(in[j - 1].pos) + ")");
    arena.check_slot(in[i].slot);
    // A run writes all its K/V before attending: the rings' headroom (kv_layout.h) bounds it as it bounds a chunk.
    if (j - i > layout_.chunk())
      throw std::invalid_argument("decode: slot " + std::to_string(in[i].slot) + " has " + std::to_string(j - i) +
                                  " tokens in one step, more than the chunk (" + std::to_string(layout_.chunk()) + ")");
    arena.check_write(in[i].slot, in[i].pos, j - i);
    slots.push_back(in[i].slot);
    i = j;
  }
  for (int i = 0; i < n; ++i) {
    check_token(in[i].token, "tokens", i);
    wanted += in[i].logits ? 1 : 0;
  }
  std::sort(slots.begin(), slots.end());
  const auto dup = std::adjacent_find(slots.begin(), slots.end());
  if (dup != slots.end())
    throw std::invalid_argument("decode: slot " + std::to_string(*dup) +
                                " appears twice in one batch (a sequence's tokens are consecutive entries)");
  for (int i = 0; i < n; ++i) check_prefix(arena, in, i, slots);
  return wanted;
}

void Model::check_prefix(const KvArena& arena, const DecodeRow* in, int i, const std::vector<int>& step_slots) const {
  const DecodeRow& r = in[i];
  const std::string who = "decode: entry " + std::to_string(i) + " (slot " + std::to_string(r.slot) + ")";
  if (i > 0 && in[i - 1].slot == r.slot &&
      (in[i - 1].prefix_slot != r.prefix_slot || in[i - 1].prefix_len != r.prefix_len))
    throw std::invalid_argument(who + " names another prefix than the token before it in its run");
  if (r.prefix_slot < 0) {
    if (r.prefix_slot != -1 || r.prefix_len != 0)
      throw std::invalid_argument(who + ": a prefix needs a slot >= 0 and a length (got slot " +
                                  std::to_string(r.prefix_slot) + ", length " + std::to_string(r.prefix_len) + ")");
    return;
  }
  arena.check_slot(r.prefix_slot);
  if (std::binary_search(step_slots.begin(), step_slots.end(), r.prefix_slot))
    throw std::invalid_argument(who + ": prefix slot " + std::to_string(r.prefix_slot) +
                                " is written in this step; a prefix slot is only read");
  if (r.prefix_len < 1 || r.prefix_len > r.pos)
    throw std::invalid_argument(who + ": the prefix length must be in [1, position " + std::to_string(r.pos) +
                                "], got " + std::to_string(r.prefix_len));
  const uint32_t held = arena.n_tokens(r.prefix_slot);
  const std::string err = layout_.resume_error(held, r.prefix_len);
  if (!err.empty())
    throw std::invalid_argument(who + ": prefix slot " + std::to_string(r.prefix_slot) +
                                " does not hold positions [0, " + std::to_string(r.prefix_len) + "): " + err);
}

int Model::decode(KvArena& arena, const DecodeRow* in, int n, float* out) {
  std::lock_guard<std::mutex> lock(run_mu_);
  const int wanted = check_decode(arena, in, n);

  backend_thread_init();
  seq_begin_.clear();  // grows to the largest batch seen, then allocates no more
  for (int i = 0; i < n; ++i)
    if (i == 0 || in[i].slot != in[i - 1].slot) seq_begin_.push_back(i);
  const int S = int(seq_begin_.size());
  seq_begin_.push_back(n);
  for (int s = 0; s < S; ++s) arena.mark_written(in[seq_begin_[s]].slot, uint32_t(in[seq_begin_[s]].pos));
  // The passes a plain decode of the S sequences makes (max_rows_ sequences each) fix the weight encoding and the
  // attention split; a pass whose runs hold more than max_rows_ tokens is run in parts.
  for (int g0 = 0; g0 < S; g0 += max_rows_) {
    const int g1 = std::min(S, g0 + max_rows_);
    shape_rows_ = g1 - g0;
    for (int s0 = g0; s0 < g1;) {
      int s1 = s0;
      while (s1 < g1 && seq_begin_[s1 + 1] - seq_begin_[s0] <= max_rows_) ++s1;
      decode_pass(arena, in, s0, s1, out);  // s1 > s0: a run has at most chunk_ <= max_rows_ tokens
      s0 = s1;
    }
  }
  shape_rows_ = 0;
  for (int s = 0; s < S; ++s) {
    const DecodeRow& last = in[seq_begin_[s + 1] - 1];
    arena.mark_written(last.slot, uint32_t(last.pos + 1));
  }
  return wanted;
}

void Model::decode_pass(KvArena& arena, const DecodeRow* in, int s0, int s1, float*& out) {
  const ModelConfig& c = config();
  const int D = c.hidden_size, V = c.vocab_size, LP = c.num_layers * c.ple_dim, fs = c.first_shared_layer,
            L = c.num_layers;
  RowCtx* rows = rows_scratch_.data();
  int32_t* toks = tok_scratch_.data();
  // Tokens without wanted logits first (they stop at first_shared_layer), then the wanted ones in entry order.
  int m = 0;
  for (int pass = 0; pass < 2; ++pass)
    for (int i = seq_begin_[s0]; i < seq_begin_[s1]; ++i)
      if (in[i].logits == (pass == 1)) {
        rows[m] = RowCtx{arena.slot(in[i].slot), in[i].pos,
                         in[i].prefix_slot >= 0 ? arena.slot(in[i].prefix_slot) : nullptr, in[i].prefix_len};
        toks[m++] = in[i].token;
      }
  int skip = 0;
  for (int i = seq_begin_[s0]; i < seq_begin_[s1]; ++i) skip += in[i].logits ? 0 : 1;
  const int w = m - skip;
  embed(toks, m, skip);
  compute_rope(m, rows);
  run_layers(0, fs, m, rows);
  if (w == 0) return;
  if (skip > 0) {
    std::memmove(&h_[0], &h_[size_t(skip) * D], sizeof(float) * D * w);
    if (LP) std::memmove(&ple_[0], &ple_[size_t(skip) * LP], sizeof(float) * LP * w);
    std::memmove(rows, rows + skip, sizeof(RowCtx) * w);
    compute_rope(w, rows);
  }
  run_layers(fs, L, w, rows);
  lm_head(w, out);
  out += size_t(w) * V;
}

std::array<double, kNumPhases> Model::profile_seconds() const {
  std::array<double, kNumPhases> s{};
  for (int i = 0; i < kNumPhases; ++i) s[i] = prof_ns_[i] * 1e-9;
  return s;
}

void Model::reset_profile() {
  prof_ns_.fill(0);
  prof_calls_.fill(0);
}

}  // namespace sg
