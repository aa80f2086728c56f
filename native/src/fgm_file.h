// The FASTGEM1 (.fgm) weight file: mmap, zero copy, validated before use.
//
// Format: shared/reference/fgm-format.md (mirrored in docs/fgm-format.md). Opening a file
// checks the container (magic, header length, JSON), every tensor entry (dtype, shape,
// offset, size, alignment, overlaps, companion scales, quantisation meta) against the file
// size, and the tensor inventory against the model config. Any failure throws FgmError
// naming the file, the tensor and the problem; nothing is read out of bounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "json.h"

namespace sg {

// The exit status of a process whose mapped model file was truncated or rewritten under it (fgm_file.cpp: the
// SIGBUS guard). EX_IOERR of sysexits.h.
constexpr int kExitModelFileChanged = 74;

class FgmError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Q8GA: q8g with one f32 offset per group beside its scale (docs/fgm-extensions.md), for a GGUF's blocks with minimums.
enum class DType : uint8_t { F32, F16, Q4G, Q8C, Q4R, Q8R, Q8G, Q8GA };
// q8g or q8ga: the 16-column panel layout (the same codes, scales and kernels; q8ga adds the offsets).
inline bool is_paneled(DType t) { return t == DType::Q8G || t == DType::Q8GA; }
const char* dtype_name(DType t);

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  int hadamard = 0;  // 128 when the weight is Hadamard-rotated along K
  int group = 0;     // scale group along K (q4g, q8g, q8ga); 0 otherwise
  const uint8_t* data = nullptr;  // into the mapping
  int64_t rows() const { return shape.empty() ? 0 : shape[0]; }
  int64_t cols() const { return shape.size() < 2 ? 0 : shape[1]; }
};

// Per-layer facts derived once from the config.
struct LayerSpec {
  bool sliding = false;
  int head_dim = 0;
  int intermediate = 0;
  bool owns_kv = false;   // layer < first_shared_layer: computes and stores K/V
  int kv_source = 0;      // the layer whose K/V cache this layer attends over
};

struct ModelConfig {
  int hidden_size = 0;
  int num_layers = 0;
  int intermediate_size = 0;
  bool double_wide_mlp = false;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int global_head_dim = 0;
  int first_shared_layer = 0;
  int ple_dim = 0;  // hidden_size_per_layer_input; 0 = no per-layer embeddings
  int vocab_size = 0;
  int ple_vocab_size = 0;
  int sliding_window = 0;
  double rms_norm_eps = 1e-6;
  double final_softcap = 0.0;  // 0 = no softcap
  double embed_scale = 1.0;
  double ple_embed_scale = 1.0;
  double ple_model_projection_scale = 1.0;
  double ple_input_scale = 1.0;
  // Where Gemma 3 differs from Gemma 4; absent keys mean Gemma 4 (fastgemma's files carry none of them).
  double attention_scale = 1.0;  // multiplies q.k (Gemma 3: query_pre_attn_scalar^-1/2)
  bool use_v_norm = true;        // weightless RMSNorm of v per head
  bool use_layer_scalar = true;
  // The K/V cache element type the model asks for ("int8" or "f16"; "" = absent, the engine's default int8).
  // splitgemma's converter sets f16 for q8g files (docs/fgm-extensions.md); a caller can override it.
  std::string kv_cache_dtype;  // l<i>.layer_scalar exists and scales each layer's output
  std::vector<LayerSpec> layers;
  std::vector<int> store_full_length_kv;
};

class FgmFile {
 public:
  explicit FgmFile(const std::string& path);
  ~FgmFile();
  FgmFile(const FgmFile&) = delete;
  FgmFile& operator=(const FgmFile&) = delete;

  const std::string& path() const { return path_; }
  const ModelConfig& config() const { return config_; }
  const std::string& header_json() const { return header_json_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  uint64_t file_size() const { return size_; }
  const uint8_t* base() const { return base_; }

  const TensorInfo* find(const std::string& name) const;
  const TensorInfo& require(const std::string& name) const;  // throws FgmError when absent

  // A 64-bit fingerprint of everything that fixes the model's layout (config and tensor
  // table, not the file-level conversion stats). Two processes that mapped files with the
  // same signature agree on every KV layout and weight address.
  uint64_t layout_signature() const { return signature_; }

 private:
  [[noreturn]] void fail(const std::string& what) const;
  void parse_header();
  void parse_tensors(const JsonValue& tensors);
  void parse_config(const JsonValue& cfg);
  void check_inventory();
  void check_linear(const std::string& name, int64_t n, int64_t k) const;
  void check_table(const std::string& name, int64_t r, int64_t k) const;
  void check_plain(const std::string& name, DType dt, const std::vector<int64_t>& shape) const;
  void check_q8g_scale(const std::string& name, const std::vector<int64_t>& shape) const;
  void check_vector(const std::string& name, int64_t n) const;
  void compute_signature();

  std::string path_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  std::string header_json_;
  ModelConfig config_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;
  uint64_t signature_ = 0;
};

}  // namespace sg
