#include "fgm_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>

namespace sg {

namespace {

constexpr char kMagic[8] = {'F', 'A', 'S', 'T', 'G', 'E', 'M', '1'};
constexpr int64_t kMaxDim = int64_t(1) << 40;  // far beyond any real tensor; keeps products exact

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << '[';
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << ']';
  return o.str();
}

bool parse_dtype(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> table[] = {{"f32", DType::F32}, {"f16", DType::F16},
                                                        {"q4g", DType::Q4G}, {"q8c", DType::Q8C},
                                                        {"q4r", DType::Q4R}, {"q8r", DType::Q8R},
                                                        {"q8g", DType::Q8G},   {"q8ga", DType::Q8GA}};
  for (const auto& e : table)
    if (s == e.first) { *out = e.second; return true; }
  return false;
}


// ---------------------------------------------------------------------------------------------------------------
// A model file truncated (or replaced in place) while a process has it mapped: the next read of a page past the new
// end raises SIGBUS, which would kill the worker with no word of why. It cannot be made impossible from here: a
// private copy costs the file's size in RAM, and locking the file (flock) is advisory, so `truncate` or a converter
// rewriting the file still goes ahead. So a SIGBUS handler looks at the faulting address: inside a mapped .fgm it
// writes one line naming the file and ends the process with kExitModelFileChanged (an orderly exit: the status
// says why, the supervisor restarts it, the next start sweeps its shared memory). A fault anywhere else goes on to
// the handler that was there before (or the default action), as if this one did not exist.
//
// The handler may only use async-signal-safe calls, so the mappings live in a fixed table of atomics, written
// under a mutex by the constructor and destructor and read lock-free by the handler.

struct MappedRange {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  char path[480] = {};
};
constexpr int kMaxMapped = 64;  // more FgmFiles than this at once are not guarded (none of our processes has more than 2)
MappedRange g_mapped[kMaxMapped];
std::mutex g_mapped_mutex;
struct sigaction g_previous_sigbus;
std::once_flag g_sigbus_once;

void write_all(const char* s, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(2, s, n);
    if (w <= 0) return;
    s += w;
    n -= size_t(w);
  }
}

void write_str(const char* s) { write_all(s, std::strlen(s)); }

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info ? info->si_addr : nullptr);
  for (const MappedRange& m : g_mapped) {
    const uintptr_t b = m.begin.load(std::memory_order_acquire), e = m.end.load(std::memory_order_acquire);
    if (b != 0 && addr >= b && addr < e) {
      char offset[24];
      int n = 0;
      for (uintptr_t v = addr - b; n == 0 || v; v /= 10) offset[n++] = char('0' + v % 10);
      write_str("splitgemma: fatal: the model file ");
      write_str(m.path);
      write_str(" was truncated or rewritten while this process had it mapped (SIGBUS reading offset ");
      while (n) write_all(&offset[--n], 1);
      write_str("); exiting. Replace a model file by renaming a new one over it, never in place.\n");
      ::_exit(kExitModelFileChanged);
    }
  }
  // Not ours: hand over to whoever was there before.
  if (g_previous_sigbus.sa_flags & SA_SIGINFO) {
    if (g_previous_sigbus.sa_sigaction) return g_previous_sigbus.sa_sigaction(sig, info, context);
  } else if (g_previous_sigbus.sa_handler != SIG_DFL && g_previous_sigbus.sa_handler != SIG_IGN) {
    return g_previous_sigbus.sa_handler(sig);
  }
  // Default action: re-arm it and return; the faulting access runs again and the kernel ends the process.
  signal(SIGBUS, SIG_DFL);
}

void install_sigbus_handler() {
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_previous_sigbus);
}

void guard_mapping(const void* base, uint64_t size, const std::string& path) {
  std::call_once(g_sigbus_once, install_sigbus_handler);
  std::lock_guard<std::mutex> lock(g_mapped_mutex);
  for (MappedRange& m : g_mapped) {
    if (m.begin.load(std::memory_order_relaxed) != 0) continue;
    const size_t n = std::min(path.size(), sizeof m.path - 1);
    std::memcpy(m.path, path.data(), n);
    m.path[n] = '\0';
    m.end.store(reinterpret_cast<uintptr_t>(base) + size, std::memory_order_release);
    m.begin.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    return;
  }
}

void unguard_mapping(const void* base) {
  std::lock_guard<std::mutex> lock(g_mapped_mutex);
  for (MappedRange& m : g_mapped)
    if (m.begin.load(std::memory_order_relaxed) == reinterpret_cast<uintptr_t>(base)) {
      m.begin.store(0, std::memory_order_release);
      m.end.store(0, std::memory_order_release);
    }
}

}  // namespace

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::Q4G: return "q4g";
    case DType::Q8C: return "q8c";
    case DType::Q4R: return "q4r";
    case DType::Q8R: return "q8r";
    case DType::Q8G: return "q8g";
    case DType::Q8GA: return "q8ga";
  }
  return "?";
}

FgmFile::FgmFile(const std::string& path) : path_(path) {
  // O_NONBLOCK: opening a FIFO for reading blocks until a writer appears (forever, for a model path); with it the
  // open returns at once and the S_ISREG check below refuses the FIFO. It is cleared again for the regular file.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd_ < 0) fail(std::string("cannot open: ") + std::strerror(errno));
  struct stat st;
  if (fstat(fd_, &st) != 0) {
    int e = errno;
    ::close(fd_);
    fd_ = -1;
    fail(std::string("cannot stat: ") + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    fail("not a regular file");
  }
  if (int fl = fcntl(fd_, F_GETFL); fl < 0 || fcntl(fd_, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    int e = errno;
    ::close(fd_);
    fd_ = -1;
    fail(std::string("cannot clear O_NONBLOCK: ") + std::strerror(e));
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ < 12) {
    ::close(fd_);
    fd_ = -1;
    fail("file is " + std::to_string(size_) + " bytes, too short for the 12-byte FASTGEM1 preamble (truncated?)");
  }
  void* p = mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    ::close(fd_);
    fd_ = -1;
    fail(std::string("mmap failed: ") + std::strerror(e));
  }
  base_ = static_cast<uint8_t*>(p);
  // Ask for 2 MB pages: pages of the file the page cache does not hold yet are then read in as 2 MB folios, each
  // mapped by one PMD (FileHugePages, FilePmdMapped in /proc/meminfo), however the faults come (Linux 6.18's
  // readahead reached them for sequential reads without the advice too). Decode streams the weights at the bandwidth
  // limit and pays for every TLB miss: on a 2-core Xeon KVM guest a single-stream E2B step took 61-62 ms on 2 MB
  // folios against 77-79 ms on the small pages the cache had held since before (docs/benchmarks.md, session 23).
  // Pages already cached stay as they are; a kernel without THP for files refuses, which costs nothing.
  madvise(p, size_, MADV_HUGEPAGE);
  guard_mapping(base_, size_, path_);
  try {
    parse_header();
    check_inventory();
    compute_signature();
  } catch (...) {
    unguard_mapping(base_);
    munmap(base_, size_);
    ::close(fd_);
    base_ = nullptr;
    fd_ = -1;
    throw;
  }
}

FgmFile::~FgmFile() {
  if (base_) {
    unguard_mapping(base_);
    munmap(base_, size_);
  }
  if (fd_ >= 0) ::close(fd_);
}

void FgmFile::fail(const std::string& what) const { throw FgmError(path_ + ": " + what); }

const TensorInfo* FgmFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& FgmFile::require(const std::string& name) const {
  const TensorInfo* t = find(name);
  if (!t) fail("required tensor '" + name + "' is missing");
  return *t;
}

void FgmFile::parse_header() {
  if (std::memcmp(base_, kMagic, 8) != 0) {
    bool zeros = std::all_of(base_, base_ + 8, [](uint8_t b) { return b == 0; });
    fail(zeros ? "no FASTGEM1 magic (the first 8 bytes are zero: an interrupted or failed conversion)"
               : "bad magic: not a FASTGEM1 .fgm file");
  }
  uint32_t hlen;
  std::memcpy(&hlen, base_ + 8, 4);
  if (hlen == 0) fail("header length is 0");
  if (uint64_t(hlen) > size_ - 12)
    fail("header length " + std::to_string(hlen) + " runs past the end of the file (" + std::to_string(size_) +
         " bytes): truncated or corrupt");
  header_json_.assign(reinterpret_cast<const char*>(base_ + 12), hlen);
  JsonValue root;
  try {
    root = parse_json(header_json_.data(), header_json_.size());
  } catch (const JsonError& e) {
    fail(e.what());
  }
  if (root.kind != JsonValue::Kind::Object) fail("header JSON is not an object");
  const JsonValue* cfg = root.get("config");
  const JsonValue* tens = root.get("tensors");
  if (!cfg || cfg->kind != JsonValue::Kind::Object) fail("header has no 'config' object");
  if (!tens || tens->kind != JsonValue::Kind::Object) fail("header has no 'tensors' object");
  parse_config(*cfg);
  parse_tensors(*tens);
}

void FgmFile::parse_tensors(const JsonValue& tens) {
  const uint64_t body_min = 12 + uint64_t(header_json_.size());
  tensors_.reserve(tens.obj.size());
  for (const auto& kv : tens.obj) {
    const std::string& name = kv.first;
    const JsonValue& e = kv.second;
    auto bad = [&](const std::string& what) { fail("tensor '" + name + "': " + what); };
    if (e.kind != JsonValue::Kind::Object) bad("entry is not an object");
    TensorInfo t;
    t.name = name;
    const JsonValue* dt = e.get("dtype");
    if (!dt || dt->kind != JsonValue::Kind::String) bad("missing 'dtype'");
    if (!parse_dtype(dt->str, &t.dtype)) bad("unknown dtype '" + dt->str + "'");
    const JsonValue* sh = e.get("shape");
    if (!sh || sh->kind != JsonValue::Kind::Array || sh->arr.empty() || sh->arr.size() > 4)
      bad("'shape' must be an array of 1 to 4 integers");
    int64_t numel = 1;
    for (const auto& d : sh->arr) {
      if (d.kind != JsonValue::Kind::Int || d.i <= 0 || d.i > kMaxDim) bad("bad dimension in shape");
      t.shape.push_back(d.i);
      if (numel > kMaxDim / d.i) bad("shape " + shape_str(t.shape) + " is implausibly large");
      numel *= d.i;
    }
    const JsonValue* off = e.get("offset");
    const JsonValue* nb = e.get("nbytes");
    if (!off || off->kind != JsonValue::Kind::Int || off->i < 0) bad("missing or negative 'offset'");
    if (!nb || nb->kind != JsonValue::Kind::Int || nb->i < 0) bad("missing or negative 'nbytes'");
    t.offset = uint64_t(off->i);
    t.nbytes = uint64_t(nb->i);
    uint64_t want = 0;
    switch (t.dtype) {
      case DType::F32: want = uint64_t(numel) * 4; break;
      case DType::F16: want = uint64_t(numel) * 2; break;
      case DType::Q8C: case DType::Q8R: case DType::Q8G: case DType::Q8GA: want = uint64_t(numel); break;
      case DType::Q4G: case DType::Q4R: want = uint64_t(numel) / 2; break;
    }
    if (t.nbytes != want)
      bad("nbytes " + std::to_string(t.nbytes) + " does not match dtype " + dtype_name(t.dtype) + " x shape " +
          shape_str(t.shape) + " (" + std::to_string(want) + ")");
    if (t.offset < body_min) bad("offset " + std::to_string(t.offset) + " lies inside the header");
    if (t.offset % 64 != 0) bad("offset " + std::to_string(t.offset) + " is not 64-byte aligned");
    if (t.offset > size_ || t.nbytes > size_ - t.offset)
      bad("blob [" + std::to_string(t.offset) + ", " + std::to_string(t.offset + t.nbytes) +
          ") runs past the end of the file (" + std::to_string(size_) + " bytes): truncated?");
    const bool blocked = t.dtype == DType::Q4G || t.dtype == DType::Q8C;
    const bool table = t.dtype == DType::Q4R || t.dtype == DType::Q8R;
    const bool paneled = is_paneled(t.dtype);
    if ((blocked || table || paneled) && t.shape.size() != 2)
      bad("quantised tensors must be 2-D, got " + shape_str(t.shape));
    if (blocked && (t.rows() % 16 != 0 || t.cols() % 64 != 0))
      bad("tile-ordered weight " + shape_str(t.shape) + " needs N % 16 == 0 and K % 64 == 0");
    if (t.dtype == DType::Q4R && t.cols() % 64 != 0) bad("int4 table " + shape_str(t.shape) + " needs K % 64 == 0");
    const JsonValue* meta = e.get("meta");
    if (meta && meta->kind != JsonValue::Kind::Object) bad("'meta' is not an object");
    if (blocked) {
      const JsonValue* h = meta ? meta->get("hadamard") : nullptr;
      if (h && (h->kind != JsonValue::Kind::Int || (h->i != 0 && h->i != 128))) bad("meta.hadamard must be 0 or 128");
      t.hadamard = h ? int(h->i) : 0;
      if (t.hadamard && t.cols() % t.hadamard != 0) bad("meta.hadamard 128 needs K % 128 == 0");
      if (t.dtype == DType::Q4G) {
        // Files from the oldest converter carry no group: it was always 64 then.
        const JsonValue* g = meta ? meta->get("group") : nullptr;
        if (g && (g->kind != JsonValue::Kind::Int || g->i <= 0)) bad("meta.group must be a positive integer");
        t.group = g ? int(g->i) : 64;
        if (t.group % 64 != 0 || t.cols() % t.group != 0)
          bad("int4 group " + std::to_string(t.group) + " must be a multiple of 64 dividing K = " +
              std::to_string(t.cols()));
      }
    }
    if (paneled) {
      // docs/fgm-extensions.md: 16-column panels, one f32 scale (q8ga: and offset) per (row, group of G along K),
      // never rotated.
      const std::string dn = dtype_name(t.dtype);
      if (t.rows() % 16 != 0) bad(dn + " weight " + shape_str(t.shape) + " needs N % 16 == 0 (16-column panels)");
      const JsonValue* h = meta ? meta->get("hadamard") : nullptr;
      if (h && (h->kind != JsonValue::Kind::Int || h->i != 0)) bad("meta.hadamard must be 0 for " + dn);
      const JsonValue* g = meta ? meta->get("group") : nullptr;
      if (!g || g->kind != JsonValue::Kind::Int || g->i <= 0 || t.cols() % g->i != 0)
        bad(dn + " needs meta.group, a positive integer dividing K = " + std::to_string(t.cols()));
      t.group = int(g->i);
    }
    t.data = base_ + t.offset;
    if (!index_.emplace(name, tensors_.size()).second) bad("appears twice");
    tensors_.push_back(std::move(t));
  }
  // Blobs must not overlap: two tensors sharing bytes is corruption (or an attack).
  std::vector<const TensorInfo*> order;
  for (const auto& t : tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < order.size(); ++i)
    if (order[i - 1]->offset + order[i - 1]->nbytes > order[i]->offset)
      fail("tensors '" + order[i - 1]->name + "' and '" + order[i]->name + "' overlap");
}

namespace {

int get_int(const FgmFile* f, const JsonValue& cfg, const char* key, bool required, int fallback,
            void (*failer)(const FgmFile*, const std::string&)) {
  const JsonValue* v = cfg.get(key);
  if (!v || v->kind == JsonValue::Kind::Null) {
    if (required) failer(f, std::string("config.") + key + " is missing");
    return fallback;
  }
  if (v->kind != JsonValue::Kind::Int || v->i < 0 || v->i > (int64_t(1) << 30))
    failer(f, std::string("config.") + key + " must be a non-negative integer");
  return int(v->i);
}

double get_num(const FgmFile* f, const JsonValue& cfg, const char* key, double fallback,
               void (*failer)(const FgmFile*, const std::string&)) {
  const JsonValue* v = cfg.get(key);
  if (!v || v->kind == JsonValue::Kind::Null) return fallback;
  if (!v->is_number() || !std::isfinite(v->as_double())) failer(f, std::string("config.") + key + " must be a number");
  return v->as_double();
}

bool get_bool(const FgmFile* f, const JsonValue& cfg, const char* key, bool fallback,
              void (*failer)(const FgmFile*, const std::string&)) {
  const JsonValue* v = cfg.get(key);
  if (!v || v->kind == JsonValue::Kind::Null) return fallback;
  if (v->kind != JsonValue::Kind::Bool) failer(f, std::string("config.") + key + " must be a boolean");
  return v->b;
}

}  // namespace

void FgmFile::parse_config(const JsonValue& cfg) {
  auto failer = [](const FgmFile* f, const std::string& m) { f->fail(m); };
  ModelConfig& c = config_;
  c.hidden_size = get_int(this, cfg, "hidden_size", true, 0, failer);
  c.num_layers = get_int(this, cfg, "num_hidden_layers", true, 0, failer);
  c.intermediate_size = get_int(this, cfg, "intermediate_size", true, 0, failer);
  c.num_heads = get_int(this, cfg, "num_attention_heads", true, 0, failer);
  c.num_kv_heads = get_int(this, cfg, "num_key_value_heads", true, 0, failer);
  c.head_dim = get_int(this, cfg, "head_dim", true, 0, failer);
  c.global_head_dim = get_int(this, cfg, "global_head_dim", false, c.head_dim, failer);
  c.first_shared_layer = get_int(this, cfg, "first_shared_layer", false, c.num_layers, failer);
  c.ple_dim = get_int(this, cfg, "hidden_size_per_layer_input", false, 0, failer);
  c.vocab_size = get_int(this, cfg, "vocab_size", true, 0, failer);
  c.ple_vocab_size = get_int(this, cfg, "vocab_size_per_layer_input", false, c.vocab_size, failer);
  c.sliding_window = get_int(this, cfg, "sliding_window", false, 0, failer);
  c.rms_norm_eps = get_num(this, cfg, "rms_norm_eps", 1e-6, failer);
  c.final_softcap = get_num(this, cfg, "final_logit_softcapping", 0.0, failer);
  c.embed_scale = get_num(this, cfg, "embed_scale", std::sqrt(double(c.hidden_size)), failer);
  c.ple_embed_scale = get_num(this, cfg, "ple_embed_scale", std::sqrt(double(c.ple_dim)), failer);
  c.ple_model_projection_scale =
      get_num(this, cfg, "ple_model_projection_scale", c.hidden_size ? 1.0 / std::sqrt(double(c.hidden_size)) : 1.0, failer);
  c.ple_input_scale = get_num(this, cfg, "ple_input_scale", 1.0 / std::sqrt(2.0), failer);
  c.double_wide_mlp = get_bool(this, cfg, "use_double_wide_mlp", false, failer);
  c.attention_scale = get_num(this, cfg, "attention_scale", 1.0, failer);
  c.use_v_norm = get_bool(this, cfg, "use_v_norm", true, failer);
  c.use_layer_scalar = get_bool(this, cfg, "use_layer_scalar", true, failer);
  if (const JsonValue* kd = cfg.get("kv_cache_dtype"); kd && kd->kind != JsonValue::Kind::Null) {
    if (kd->kind != JsonValue::Kind::String || (kd->str != "int8" && kd->str != "f16"))
      fail("config.kv_cache_dtype must be \"int8\" or \"f16\"");
    c.kv_cache_dtype = kd->str;
  }

  if (c.hidden_size <= 0 || c.num_layers <= 0 || c.intermediate_size <= 0 || c.num_heads <= 0 ||
      c.num_kv_heads <= 0 || c.head_dim <= 0 || c.global_head_dim <= 0 || c.vocab_size <= 0)
    fail("config has a zero dimension (hidden_size, num_hidden_layers, intermediate_size, heads, head_dim, vocab_size)");
  if (c.num_heads % c.num_kv_heads != 0) fail("config.num_attention_heads must be a multiple of num_key_value_heads");
  if (c.head_dim % 2 || c.global_head_dim % 2) fail("config head dims must be even (RoPE pairs)");
  if (c.first_shared_layer < 1 || c.first_shared_layer > c.num_layers)
    fail("config.first_shared_layer must lie in [1, num_hidden_layers]");
  // Ranges, beyond "a finite number": the engine computes in float32, where a value that passes as a double can be
  // 0 or infinite (rms_norm_eps 1e-300 rounds to 0 and an all-zero row then normalises to 0 * inf = NaN; a scale
  // of 1e300 is inf), and every size below multiplies into C++ ints. The bounds are far outside any real model
  // (Gemma 4: eps 1e-6, softcap 30, head dims 256/512, 35 layers, vocabulary 262144) and well inside float32 and
  // int32, so an accepted file cannot turn a configuration value into NaN logits or an overflowed size.
  auto within = [&](const char* key, double v, double lo, double hi) {
    if (!(v >= lo && v <= hi)) {
      char text[160];
      std::snprintf(text, sizeof text, "config.%s = %.17g is outside the supported range [%g, %g]", key, v, lo, hi);
      fail(text);
    }
  };
  within("hidden_size", c.hidden_size, 1, 1 << 16);
  within("num_hidden_layers", c.num_layers, 1, 1024);
  within("intermediate_size", c.intermediate_size, 1, 1 << 20);
  within("num_attention_heads", c.num_heads, 1, 1024);
  within("head_dim", c.head_dim, 2, 4096);
  within("global_head_dim", c.global_head_dim, 2, 4096);
  within("hidden_size_per_layer_input", c.ple_dim, 0, 1 << 16);
  within("vocab_size", c.vocab_size, 1, 1 << 24);
  within("vocab_size_per_layer_input", c.ple_vocab_size, c.ple_dim > 0 ? 1 : 0, 1 << 24);
  within("sliding_window", c.sliding_window, 0, 1 << 24);
  within("rms_norm_eps", c.rms_norm_eps, 1e-30, 1.0);
  if (c.final_softcap != 0) within("final_logit_softcapping", c.final_softcap, 1e-2, 1e6);
  within("embed_scale", c.embed_scale, 1e-6, 1e6);
  within("attention_scale", c.attention_scale, 1e-6, 1e6);
  if (c.ple_dim > 0) {
    within("ple_embed_scale", c.ple_embed_scale, 1e-6, 1e6);
    within("ple_model_projection_scale", c.ple_model_projection_scale, 1e-6, 1e6);
    within("ple_input_scale", c.ple_input_scale, 1e-6, 1e6);
  }

  const JsonValue* lt = cfg.get("layer_types");
  if (!lt || lt->kind != JsonValue::Kind::Array || int(lt->arr.size()) != c.num_layers)
    fail("config.layer_types must list one type per layer");
  bool any_sliding = false;
  for (int i = 0; i < c.num_layers; ++i) {
    const JsonValue& v = lt->arr[i];
    LayerSpec L;
    if (v.kind == JsonValue::Kind::String && v.str == "sliding_attention") L.sliding = true;
    else if (v.kind == JsonValue::Kind::String && v.str == "full_attention") L.sliding = false;
    else fail("config.layer_types[" + std::to_string(i) + "] must be 'sliding_attention' or 'full_attention'");
    any_sliding |= L.sliding;
    L.head_dim = L.sliding ? c.head_dim : c.global_head_dim;
    L.owns_kv = i < c.first_shared_layer;
    L.intermediate = c.intermediate_size * ((c.double_wide_mlp && !L.owns_kv) ? 2 : 1);
    c.layers.push_back(L);
  }
  if (any_sliding && c.sliding_window <= 0) fail("config.sliding_window must be positive when sliding layers exist");
  // A shared layer reads the cache of the last non-shared layer of its own type.
  for (int i = 0; i < c.num_layers; ++i) {
    LayerSpec& L = c.layers[i];
    if (L.owns_kv) { L.kv_source = i; continue; }
    int src = -1;
    for (int j = c.first_shared_layer - 1; j >= 0; --j)
      if (c.layers[j].sliding == L.sliding) { src = j; break; }
    if (src < 0) fail("layer " + std::to_string(i) + " shares K/V but no earlier layer of its type produces any");
    L.kv_source = src;
  }
  const JsonValue* sf = cfg.get("store_full_length_kv");
  if (sf && sf->kind == JsonValue::Kind::Array) {
    for (const auto& v : sf->arr) {
      if (v.kind != JsonValue::Kind::Int || v.i < 0 || v.i >= c.first_shared_layer)
        fail("config.store_full_length_kv lists a layer outside [0, first_shared_layer)");
      c.store_full_length_kv.push_back(int(v.i));
    }
  }
}

void FgmFile::check_plain(const std::string& name, DType dt, const std::vector<int64_t>& shape) const {
  const TensorInfo& t = require(name);
  if (t.dtype != dt || t.shape != shape)
    fail("tensor '" + name + "' is " + dtype_name(t.dtype) + " " + shape_str(t.shape) + ", expected " +
         dtype_name(dt) + " " + shape_str(shape));
}

void FgmFile::check_q8g_scale(const std::string& name, const std::vector<int64_t>& shape) const {
  // f32, or f16 where the source's scales are f16 already (a GGUF's Q8_0, Q5_0, …: docs/fgm-extensions.md).
  const TensorInfo& t = require(name);
  if ((t.dtype != DType::F32 && t.dtype != DType::F16) || t.shape != shape)
    fail("tensor '" + name + "' is " + dtype_name(t.dtype) + " " + shape_str(t.shape) + ", expected f32 or f16 " +
         shape_str(shape));
}

void FgmFile::check_vector(const std::string& name, int64_t n) const {
  // Norm weights, layer scalars and RoPE frequencies multiply every activation: a NaN or infinity among them makes
  // every logit NaN. They are a few KB, so they are checked here; the quantised weights are not (reading them all
  // would page in the whole file at start), and a NaN that comes of them is refused by the sampler.
  check_plain(name, DType::F32, {n});
  const TensorInfo& t = require(name);
  for (int64_t i = 0; i < n; ++i) {
    float v;
    std::memcpy(&v, t.data + 4 * i, 4);
    if (!std::isfinite(v)) fail("tensor '" + name + "' holds a NaN or infinity at [" + std::to_string(i) + "]");
  }
}

void FgmFile::check_linear(const std::string& name, int64_t n, int64_t k) const {
  const TensorInfo& t = require(name);
  if (t.dtype != DType::Q4G && t.dtype != DType::Q8C && !is_paneled(t.dtype))
    fail("linear weight '" + name + "' has dtype " + dtype_name(t.dtype) + ", expected q4g, q8c, q8g or q8ga");
  if (t.shape != std::vector<int64_t>{n, k})
    fail("linear weight '" + name + "' has shape " + shape_str(t.shape) + ", expected " + shape_str({n, k}));
  if (t.dtype == DType::Q8C) check_plain(name + ".scale", DType::F32, {n});
  else if (is_paneled(t.dtype)) check_q8g_scale(name + ".scale", {k / t.group, n});
  else check_plain(name + ".scale", DType::F16, {k / t.group, n});
  if (t.dtype == DType::Q8GA) check_plain(name + ".offset", DType::F32, {k / t.group, n});
}

void FgmFile::check_table(const std::string& name, int64_t r, int64_t k) const {
  const TensorInfo& t = require(name);
  if (t.dtype != DType::Q4R && t.dtype != DType::Q8R && !is_paneled(t.dtype))
    fail("gather table '" + name + "' has dtype " + dtype_name(t.dtype) + ", expected q4r, q8r, q8g or q8ga");
  if (t.shape != std::vector<int64_t>{r, k})
    fail("gather table '" + name + "' has shape " + shape_str(t.shape) + ", expected " + shape_str({r, k}));
  if (t.dtype == DType::Q8R) check_plain(name + ".scale", DType::F32, {r});
  else if (is_paneled(t.dtype)) check_q8g_scale(name + ".scale", {k / t.group, r});
  else check_plain(name + ".scale", DType::F16, {r, k / 64});
  if (t.dtype == DType::Q8GA) check_plain(name + ".offset", DType::F32, {k / t.group, r});
}

void FgmFile::check_inventory() {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, V = c.vocab_size, P = c.ple_dim, L = c.num_layers;
  check_table("embed_tokens", V, H);
  // A q8g/q8ga table is also a linear in the same layout (docs/fgm-extensions.md): it may serve as the tied LM head.
  if (find("lm_head") || !is_paneled(require("embed_tokens").dtype)) check_linear("lm_head", V, H);
  check_vector("norm", H);
  if (P > 0) {
    check_table("embed_tokens_per_layer", c.ple_vocab_size, L * P);
    check_linear("per_layer_model_projection", L * P, H);
    check_vector("per_layer_projection_norm", P);
  }
  bool seen_sliding = false, seen_full = false;
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerSpec& ly = c.layers[i];
    const std::string p = "l" + std::to_string(i) + ".";
    const int64_t hd = ly.head_dim, I = ly.intermediate;
    (ly.sliding ? seen_sliding : seen_full) = true;
    for (const char* nm : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm"})
      check_vector(p + nm, H);
    if (c.use_layer_scalar)
      check_vector(p + "layer_scalar", 1);
    else if (find(p + "layer_scalar"))
      fail("tensor '" + p + "layer_scalar' is present but config.use_layer_scalar is false");
    check_vector(p + "q_norm", hd);
    check_linear(p + "q_proj", c.num_heads * hd, H);
    check_linear(p + "o_proj", H, c.num_heads * hd);
    if (ly.owns_kv) {
      check_vector(p + "k_norm", hd);
      check_linear(p + "k_proj", c.num_kv_heads * hd, H);
      check_linear(p + "v_proj", c.num_kv_heads * hd, H);
    }
    check_linear(p + "gate_proj", I, H);
    check_linear(p + "up_proj", I, H);
    check_linear(p + "down_proj", H, I);
    for (const char* nm : {"q_proj", "o_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"}) {
      const std::string twin = p + nm + ".i8";
      if (const TensorInfo* t = find(twin)) {
        const TensorInfo& primary = require(p + nm);
        if (t->dtype != DType::Q8C || t->shape != primary.shape)
          fail("int8 twin '" + twin + "' must be q8c " + shape_str(primary.shape));
        check_plain(twin + ".scale", DType::F32, {primary.rows()});
      }
    }
    if (P > 0) {
      check_vector(p + "post_per_layer_input_norm", H);
      check_linear(p + "per_layer_input_gate", P, H);
      check_linear(p + "per_layer_projection", H, P);
    }
  }
  if (seen_sliding) check_vector("rope.sliding_attention.inv_freq", c.head_dim / 2);
  if (seen_full) check_vector("rope.full_attention.inv_freq", c.global_head_dim / 2);
}

void FgmFile::compute_signature() {
  // FNV-1a over a canonical text of the layout. Conversion stats (header 'meta') are left out
  // on purpose: two conversions of one checkpoint differ there and nowhere else.
  std::ostringstream o;
  const ModelConfig& c = config_;
  o << c.hidden_size << ',' << c.num_layers << ',' << c.num_heads << ',' << c.num_kv_heads << ',' << c.head_dim << ','
    << c.global_head_dim << ',' << c.first_shared_layer << ',' << c.sliding_window << ',' << c.vocab_size << ';';
  for (const auto& l : c.layers) o << l.sliding << l.head_dim << '/' << l.kv_source << ';';
  for (const auto& t : tensors_) o << t.name << ':' << dtype_name(t.dtype) << shape_str(t.shape) << '@' << t.offset << ';';
  const std::string s = o.str();
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  signature_ = h;
}

}  // namespace sg
