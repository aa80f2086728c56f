// The Gemma 4 text forward pass over a .fgm file (spec: shared/reference/gemma4-e2b-spec.md §3).
//
// Everything is configured by the file's config: E2B, E4B, any dense Gemma 4 text shape, and Gemma 3 through its
// flags (attention_scale, no v-norm, no layer scalar, no per-layer inputs; its norms are stored as 1 + w, so every
// norm multiplies by the stored weight). A Model resolves every weight once, owns the thread pool and all scratch
// (sized at construction for max(chunk, max_batch) rows, so the hot path allocates nothing), and runs two entry
// points over K/V slots in a caller-provided KvArena:
//   prefill: one sequence, a prompt processed in chunks, logits of the last row or of every row;
//   decode:  B sequences (each its own slot), one pass over the weights; a sequence brings one token or a run of
//            consecutive ones (a forced run, a draft to verify), each with a flag saying whether its logits are wanted.
// Rows never interact except through the K/V they attend over (activations are quantised per row), so a sequence
// decoded in a batch gives the same numbers as decoded alone, and a token decoded in a run the same as one by one.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "fgm_file.h"
#include "huge_pages.h"
#include "kernels/gemm.h"
#include "kv_layout.h"
#include "threadpool.h"

namespace sg {

struct SampleRow;   // row_sampler.h
struct RowOutcome;  // row_sampler.h

namespace ops {
struct Elementwise;  // ops.h
struct AttnCache;    // ops.h
struct AttnSpanRow;  // ops.h
}

// A vector whose data starts on a cache line: the engine's scratch rows are read and written 64 bytes at a time
// (zmm), and a plain vector's large blocks start 16 bytes into a page, so every such access would straddle two
// lines; the GEMMs' streaming stores (kernels_impl.h) need aligned rows outright, and the packed activations
// aligned tile loads. (Gemma rows are multiples of 16 floats, so each row starts on a line too.) Blocks of 2 MB and
// more (a prefill chunk's activations, the RoPE table) are stream_alloc's (huge_pages.h): on transparent huge pages
// where the kernel gives them.
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(stream_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { stream_free(p, n * sizeof(T)); }
  bool operator==(const CacheLineAllocator&) const { return true; }
  bool operator!=(const CacheLineAllocator&) const { return false; }
};
template <class T>
using LineVector = std::vector<T, CacheLineAllocator<T>>;

// Which of a weight's two encodings a GEMM uses when the file has an int8 twin (`<name>.i8`).
// FGM_WEIGHTS=int4 | int8 | auto:M (default auto:16: the int8 twin when the GEMM has >= M rows, i.e. prefill
// chunks; int4 for decode, which is bound by reading the weights).
struct WeightPolicy {
  enum Mode { Int4, Int8, Auto } mode = Auto;
  int min_rows = 16;
  static WeightPolicy parse(const std::string& spec);  // throws std::invalid_argument
  std::string str() const;
};

struct DualLinear {
  QLinear w;   // as stored: q4g or q8c
  QLinear i8;  // the int8 twin; codes == nullptr when the file has none
  const QLinear& pick(int rows, const WeightPolicy& p) const {
    if (!i8.codes || p.mode == WeightPolicy::Int4) return w;
    return (p.mode == WeightPolicy::Int8 || rows >= p.min_rows) ? i8 : w;
  }
};

struct LayerWeights {
  const float* input_ln = nullptr;
  const float* post_attn_ln = nullptr;
  const float* pre_ffn_ln = nullptr;
  const float* post_ffn_ln = nullptr;
  const float* post_ple_ln = nullptr;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float layer_scalar = 1.0f;     // 1 when the model has none (config.use_layer_scalar false)
  DualLinear q, k, v, o, gate, up, down, ple_gate, ple_proj;
};

struct GatherTable {
  DType dtype = DType::Q4R;
  int rows = 0, cols = 0;
  int group = 0;  // q8g: scale group along the row
  const uint8_t* codes = nullptr;
  const void* scales = nullptr;  // f16 [rows][cols/64] (q4r), f32 [rows] (q8r) or f32/f16 [cols/group][rows] (q8g)
  bool scales_f16 = false;        // q8g: f16 scales
  const float* offsets = nullptr;  // a q8ga table (dtype Q8G here): f32 [cols/group][rows]; else null
  void row(int r, float mult, float* out) const;
};

struct ModelOptions {
  int threads = 0;        // 0: FGM_THREADS, else the number of online CPUs
  int max_context = 4096; // longest sequence a slot holds
  int chunk = 256;        // prefill rows per forward pass
  int max_batch = 8;      // decode rows per forward pass (more are processed in several passes)
  std::string weights;    // "" : FGM_WEIGHTS, else auto:16
  std::string backend;    // "" : the process's active_backend() (FGM_BACKEND or CPUID); else amx|vnni|avx2
  std::string kv_dtype;   // "" : the file's config.kv_cache_dtype, else int8; or "int8" | "f16"
  std::string q8g_input;  // "" : FGM_Q8G_INPUT, else int8 (f32 on the AVX2 backend); or "int8" | "f32" (gemm.h)
};

// One token of a decode step. Consecutive entries with the same slot are one sequence's run: at consecutive
// positions, causal within the run (every token's K/V is written before any of them attends, as in a prefill chunk).
//
// A shared prefix: with prefix_slot >= 0 the token reads the K/V of positions [0, prefix_len) from that slot instead
// of its own (whose rows below prefix_len are never read), so sequences that start with the same prompt can keep one
// copy of it. On the vnni and amx backends every row naming the same prefix attends it together, each K/V tile read
// once per block of rows (ops.h attend_spans_avx512): the cascade that makes a wide batch over one long prompt cheap.
// The prefix slot is only read: it must hold positions [0, prefix_len) for every layer (its rings too), prefix_len
// <= pos, and it may not be one of the step's slots. Every token of a run names the same prefix.
struct DecodeRow {
  int slot = 0;
  int token = 0;
  int pos = 0;
  bool logits = true;  // false: nobody reads this token's logits (no LM head; no KV-shared layers, spec §3.5)
  int prefix_slot = -1;
  int prefix_len = 0;
};

enum Phase : int {
  kEmbed, kPle, kNorms, kActQuant, kQkvGemm, kQkRopeKv, kAttention, kOGemm, kFfnGemm, kFfnAct, kPleInject,
  kLmHead, kNumPhases
};
const char* phase_name(int p);

class Model {
 public:
  Model(std::shared_ptr<const FgmFile> file, const ModelOptions& opt);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const FgmFile& file() const { return *file_; }
  // The token-embedding gather table as the forward pass reads it (tests: its rows against the GGUF's values).
  const GatherTable& embedding() const { return embed_; }
  const ModelConfig& config() const { return file_->config(); }
  const KvLayout& kv_layout() const { return layout_; }
  int threads() const { return pool_->size(); }
  // sample_rows (row_sampler.h) on this model's pool, serialised with the forward passes as they are.
  void sample_rows(const SampleRow* rows, int n, RowOutcome* out);
  int chunk() const { return chunk_; }
  int max_rows() const { return max_rows_; }
  const WeightPolicy& weight_policy() const { return policy_; }
  // Switches the policy between passes (a bench measures prefill as the prefill worker runs it and decode as the
  // decode worker does, on one model). Throws std::invalid_argument for a bad spec, leaving the policy unchanged.
  void set_weight_policy(const std::string& spec);
  Backend backend() const { return backend_; }
  Q8gInput q8g_input() const { return q8g_input_; }

  // Runs tokens[0..T) at positions pos0.. into `slot`; writes the last row's logits (out[V]) or, with
  // all_logits, every row's (out[T][V]). Throws std::invalid_argument / std::out_of_range before touching the
  // slot when an argument is invalid.
  void prefill(KvArena& arena, int slot, const int32_t* tokens, int T, int pos0, bool all_logits, float* out);
  // The checks prefill() starts with (callers can run them before allocating the output).
  void check_prefill(const KvArena& arena, int slot, const int32_t* tokens, int T, int pos0) const;
  // n tokens of B sequences (distinct slots, each a run of consecutive entries of at most chunk() tokens); out[W][V]
  // for the W tokens whose logits are wanted, in entry order. Returns W. The numbers of every token equal those
  // of a plain one-token-per-sequence decode of the same B sequences (docs/engine-api.md says why).
  int decode(KvArena& arena, const DecodeRow* rows, int n, float* out);
  // The checks decode() starts with; returns W (callers allocate the output with it).
  int check_decode(const KvArena& arena, const DecodeRow* rows, int n) const;

  bool profiling() const { return profiling_; }
  // Seconds and call counts per phase since construction or the last reset.
  std::array<double, kNumPhases> profile_seconds() const;
  std::array<uint64_t, kNumPhases> profile_calls() const { return prof_calls_; }
  void reset_profile();

 private:
  struct RowCtx {
    uint8_t* slot;
    int pos;
    const uint8_t* prefix = nullptr;  // DecodeRow::prefix_slot's memory: positions < prefix_len are read there
    int prefix_len = 0;
  };
  class Timer;

  void resolve_weights();
  DualLinear dual(const std::string& name) const;
  void check_arena(const KvArena& arena) const;
  void check_token(int token, const char* what, int index) const;
  // Entry i's shared prefix (DecodeRow); step_slots: the step's slots, sorted.
  void check_prefix(const KvArena& arena, const DecodeRow* in, int i, const std::vector<int>& step_slots) const;

  // Embeddings and per-layer inputs of m rows; rows >= full_from get the per-layer inputs of every layer, the
  // others only those of layers < first_shared_layer (spec §3.5: the shared layers run only where logits are needed).
  void embed(const int32_t* tokens, int m, int full_from);
  void compute_rope(int m, const RowCtx* rows);
  void run_layers(int l0, int l1, int m, const RowCtx* rows);
  // Whether the chunk's attention takes the tile kernel: prefill rows of one slot at consecutive positions.
  bool attend_rows_ok(int m, const RowCtx* rows, int group, int head_dim, const KvLayerLayout& src) const;
  // Whether the tile kernel (ops.h attend_spans_avx512, or attend_spans_avx2 on the avx2 backend) can attend a
  // layer's heads here.
  bool tile_kernel_runs(int group, int head_dim, const KvLayerLayout& src) const;
  // The tile kernel of backend_'s instruction set: n rows' spans of one KV head's cache c.
  void attend_spans(const ops::AttnSpanRow* rows, int n, int group, int head_dim, const ops::AttnCache& c,
                    float* scratch) const;
  // The attention of a decode pass in which some row reads a shared prefix: every row's positions as parts (the
  // prefix's on the absolute grid of kAttendPartPositions, its own as attend_parts of their span), merged in order.
  void attend_prefixed(int m, const RowCtx* rows, int l, const float* q, float* attn);
  void lm_head(int m, float* out);
  // One decode pass over the runs [s0, s1) of seq_begin_ (at most max_rows_ tokens); logits rows go to *out.
  void decode_pass(KvArena& arena, const DecodeRow* in, int s0, int s1, float*& out);
  // The rows that choose the weight encoding (DualLinear::pick) and the attention split: those of the pass when 0
  // (prefill), else the sequences of the plain decode pass this step stands for, however many tokens it carries.
  int shape_rows(int m) const { return shape_rows_ ? shape_rows_ : m; }
  // Quantises x[m][k] once per distinct Hadamard setting and runs every weight of the group on it.
  struct GemmOut {
    const DualLinear* w;
    float* y;
    int ldy = 0;  // 0: the weight's row count
  };
  // The group's input made row by row (an RMS norm of h, the GELU of gate and up; src.fill writes row r, k floats).
  // When every weight of the group reads int8 activations the rows go straight into the quantiser
  // (quantize_activations_from: no m x k array is written and read back); when one reads f32 x (q8g) they are first
  // written to x (row stride ldx), timed as `phase`.
  struct RowPrep {
    RowSource src;
    int phase;
  };
  void gemm_group(float* x, int ldx, int m, int k, std::initializer_list<GemmOut> outs, int phase,
                  const RowPrep* prep = nullptr);
  template <class F>
  void for_rows(int m, int64_t work_per_row, F&& f);
  // row = gelu_tanh(g) * u over n floats (row may be g).
  void gelu_row(const float* g, const float* u, int n, float* row) const;

  std::shared_ptr<const FgmFile> file_;
  WeightPolicy policy_;
  Backend backend_;
  Q8gInput q8g_input_ = Q8gInput::Int8;
  bool amx_attention_ = false;  // the prefill tile kernel's int8 dot products on AMX tiles (ops.h attend_rows_avx512)
  // Query vectors per block of that kernel.
  int attend_vectors() const;
  // The element-wise kernels and the activation quantiser of backend_'s instruction set: zmm on the VNNI and AMX
  // backends, ymm on AVX2 (ops.h, gemm.h; both give the same bits).
  const ops::Elementwise* ew_ = nullptr;
  void (*quantize_)(const float* x, int ldx, int m, int k, int hadamard, QAct* out, ThreadPool* pool) = nullptr;
  void (*quantize_from_)(const RowSource& src, int m, int k, int hadamard, QAct* out, ThreadPool* pool) = nullptr;
  int chunk_ = 0, max_rows_ = 0;
  KvLayout layout_;
  std::unique_ptr<ThreadPool> pool_;
  std::mutex run_mu_;  // one forward at a time: the scratch is shared

  // Weights.
  GatherTable embed_, ple_table_;
  DualLinear lm_head_, ple_model_proj_;
  DualLinear ple_proj_head_;  // the first first_shared_layer * P rows of ple_model_proj_ (codes == nullptr: none)
  const float* ple_proj_norm_ = nullptr;
  const float* final_norm_ = nullptr;
  const float* inv_freq_[2] = {nullptr, nullptr};  // [0] full, [1] sliding
  std::vector<LayerWeights> layers_;
  std::vector<std::vector<float>> q_norm_scaled_;  // per layer: q_norm x attention_scale (when that is not 1)

  // Scratch, [max_rows_] rows each.
  LineVector<float> h_, x_, q_, k_, v_, attn_, tmp_, gate_, up_, ple_, pg_;
  LineVector<float> rope_cs_[2];  // per type: [row][cos(half) | sin(half)]
  // Per type: [position][cos(half) | sin(half)] for positions [0, rope_filled_), filled as positions are first met;
  // the first min(max_context, kRopeTablePositions) positions have a row (E2B: 3 KB each, 24 MB in all at 8192).
  static constexpr int kRopeTablePositions = 8192;
  LineVector<float> rope_table_[2];
  int rope_positions_ = 0, rope_filled_[2] = {0, 0};
  LineVector<float> row_scratch_;  // per worker: max(L*P gather row, attention scores)
  LineVector<float> attn_parts_;   // decode attention split over positions: each part's outputs and stats
  struct PrefixItem {
    int first, count;  // rows prefix_rows_[first, first + count): one block of rows naming one prefix
    int head, part;    // KV head; the prefix part (positions [part, part + 1) x kAttendPartPositions)
  };
  struct PrefixSpan {
    int lo, own;       // the row's first position; its first position in its own slot
    int part0, parts;  // its prefix parts (absolute part indices part0 ..), then own_parts of its own positions
    int own_parts;
  };
  std::vector<PrefixItem> prefix_items_;  // attend_prefixed's work, reused from layer to layer
  std::vector<PrefixSpan> prefix_spans_;  // per row
  std::vector<int> prefix_rows_;          // the rows that read a prefix, grouped by the prefix they name
  size_t row_scratch_per_worker_ = 0;
  LineVector<int8_t> qa_packed_;
  std::vector<float> qa_scale_;
  std::vector<int32_t> qa_rowsum_;
  QAct qact_{};
  std::vector<RowCtx> rows_scratch_;
  std::vector<int32_t> tok_scratch_;
  std::vector<int> seq_begin_;  // decode: first entry of each run, then n
  int shape_rows_ = 0;

  bool profiling_ = false;
  std::array<uint64_t, kNumPhases> prof_ns_{}, prof_calls_{};
};

}  // namespace sg
