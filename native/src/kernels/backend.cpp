// Backend choice (CPUID, FGM_BACKEND, the AMX permission grant), argument checks and the
// threaded dispatch of gemm(). Compiled without ISA flags: it must run on any x86-64.
#include <cpuid.h>
#include <emmintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "gemm.h"
#include "kernels_impl.h"

namespace sg {
namespace detail {

std::atomic<int> g_amx_guard{-1};
std::atomic<uint64_t> g_amx_recoveries{0};

// Linux: ask for the AMX tile-data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool amx_request_permission() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool cpu_is_amd() {
  static const bool amd = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    char vendor[13];
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    vendor[12] = '\0';
    return std::string(vendor) == "AuthenticAMD";
  }();
  return amd;
}

}  // namespace detail

namespace {

struct CpuFeatures {
  bool avx2 = false;    // AVX2 + FMA + F16C, with the OS saving ymm state
  bool avx512 = false;  // F + BW + VL, with the OS saving zmm/opmask state
  bool vnni = false;    // AVX512_VNNI
  bool amx = false;     // AMX-TILE + AMX-INT8 (permission still to be requested)
  bool amx_bf16 = false;  // and AMX-BF16
};

uint64_t xgetbv0() {
  uint32_t lo, hi;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave) return f;
  const uint64_t xcr0 = xgetbv0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6, os_zmm = (xcr0 & 0xE6) == 0xE6;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = os_ymm && fma && f16c && (b & (1u << 5));
  f.avx512 = f.avx2 && os_zmm && (b & (1u << 16)) && (b & (1u << 30)) && (b & (1u << 31));
  f.vnni = f.avx512 && (c & (1u << 11));
  // AMX implies AVX-512 VNNI and VBMI (every AMX CPU has both; a hypervisor that masks one gets no AMX backend): the
  // engine's zmm kernels run on both the vnni and amx backends, and the AMX q8g kernel permutes bytes with vpermb.
  f.amx = f.vnni && (c & (1u << 1)) && (d & (1u << 24)) && (d & (1u << 25));
  f.amx_bf16 = f.amx && (d & (1u << 22));
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect();
  return f;
}

// The first grant decides for the process: a hypervisor that advertises AMX but refuses the
// permission makes AMX unusable everywhere.
bool amx_usable() {
  static const bool ok = features().amx && detail::amx_request_permission();
  return ok;
}

Backend decide_backend() {
  if (!cpu_supports(Backend::Avx2))
    throw std::runtime_error("this CPU lacks AVX2+FMA+F16C (or the OS does not enable them): splitgemma needs at "
                             "least the AVX2 backend");
  const char* env = std::getenv("FGM_BACKEND");
  if (env && *env) {
    Backend b;
    try {
      b = backend_from_name(env);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(std::string("FGM_BACKEND: ") + e.what());
    }
    if (!cpu_supports(b))
      throw std::runtime_error(std::string("FGM_BACKEND=") + env + " but this CPU cannot run the " + env + " backend");
    return b;
  }
  if (cpu_supports(Backend::Amx)) return Backend::Amx;
  if (cpu_supports(Backend::Vnni)) return Backend::Vnni;
  return Backend::Avx2;
}

void check_gemm_args(const QAct& a, const QLinear& w, const float* y, int ldy) {
  auto bad = [](const std::string& m) { throw std::invalid_argument("gemm: " + m); };
  if (w.dtype != DType::Q8C && w.dtype != DType::Q4G) bad("weight dtype must be q8c or q4g");
  if (w.n <= 0 || w.n % 16 != 0 || w.k <= 0 || w.k % 64 != 0)
    bad("weight shape [" + std::to_string(w.n) + ", " + std::to_string(w.k) + "] needs N % 16 == 0 and K % 64 == 0");
  if (w.dtype == DType::Q4G && (w.group <= 0 || w.group % 64 != 0 || w.k % w.group != 0))
    bad("int4 group " + std::to_string(w.group) + " must be a multiple of 64 dividing K = " + std::to_string(w.k));
  if (a.k != w.k) bad("activation K " + std::to_string(a.k) + " != weight K " + std::to_string(w.k));
  if (a.hadamard != w.hadamard)
    bad("activation hadamard " + std::to_string(a.hadamard) + " != weight hadamard " + std::to_string(w.hadamard));
  if (a.m < 0) bad("negative row count");
  if (a.m > 0 && (!a.packed || !a.scale || !a.rowsum || !y)) bad("null buffer");
  if (!w.codes || !w.scales) bad("weight without codes or scales");
  if (ldy < w.n) bad("ldy " + std::to_string(ldy) + " < N " + std::to_string(w.n));
}

}  // namespace

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::Amx: return "amx";
    case Backend::Vnni: return "vnni";
    case Backend::Avx2: return "avx2";
  }
  return "?";
}

Backend backend_from_name(const char* name) {
  const std::string s = name ? name : "";
  if (s == "amx") return Backend::Amx;
  if (s == "vnni") return Backend::Vnni;
  if (s == "avx2") return Backend::Avx2;
  throw std::invalid_argument("unknown backend '" + s + "' (expected amx, vnni or avx2)");
}

bool cpu_supports(Backend b) {
  switch (b) {
    case Backend::Avx2: return features().avx2;
    case Backend::Vnni: return features().vnni;
    case Backend::Amx: return amx_usable();
  }
  return false;
}

Backend active_backend() {
  static const Backend b = [] {
    const Backend chosen = decide_backend();
    // Which process says it: the services set SPLITGEMMA_SERVICE (splitgemma/serving/worker.py setup_logging).
    const char* who = std::getenv("SPLITGEMMA_SERVICE");
    std::fprintf(stderr, "%s: GEMM backend %s\n", who && *who ? who : "splitgemma", backend_name(chosen));
    return chosen;
  }();
  return b;
}

size_t qact_packed_bytes(int m, int k) { return (size_t)qact_padded_rows(m) * (size_t)k; }
size_t qact_rowsum_count(int m, int k) { return (size_t)qact_padded_rows(m) * (size_t)(k / 64); }
int qact_padded_rows(int m) { return (m + 15) / 16 * 16; }

TileGuardStatus amx_tile_guard_status() {
  return TileGuardStatus{detail::g_amx_guard.load(), detail::g_amx_recoveries.load()};
}

bool amx_tiles_usable() { return cpu_supports(Backend::Amx) && detail::amx_guard_off(); }
bool amx_bf16_tiles_usable() { return features().amx_bf16 && amx_tiles_usable(); }

void backend_thread_init() {
  if (amx_usable()) detail::amx_request_permission();
}

QLinear qlinear_from(const FgmFile& f, const TensorInfo& t) {
  if (t.dtype != DType::Q8C && t.dtype != DType::Q4G && !is_paneled(t.dtype))
    throw FgmError(f.path() + ": tensor '" + t.name + "' has dtype " + dtype_name(t.dtype) +
                   ", not a linear weight (q8c, q4g, q8g or q8ga)");
  if (t.shape.size() != 2) throw FgmError(f.path() + ": linear weight '" + t.name + "' is not 2-D");
  const TensorInfo& s = f.require(t.name + ".scale");
  const int64_t n = t.rows(), k = t.cols();
  const bool q8 = t.dtype == DType::Q8C;
  const DType scale_type = t.dtype == DType::Q4G ? DType::F16 : DType::F32;
  const bool type_ok = s.dtype == scale_type || (is_paneled(t.dtype) && s.dtype == DType::F16);
  const bool scale_ok = type_ok && (q8 ? s.shape == std::vector<int64_t>{n}
                                       : t.group > 0 && s.shape == std::vector<int64_t>{k / t.group, n});
  if (!scale_ok) throw FgmError(f.path() + ": '" + t.name + ".scale' does not match its weight");
  const TensorInfo* o = nullptr;
  if (t.dtype == DType::Q8GA) {
    o = &f.require(t.name + ".offset");
    if (o->dtype != DType::F32 || o->shape != s.shape)
      throw FgmError(f.path() + ": '" + t.name + ".offset' does not match its weight");
  }
  QLinear w;
  w.dtype = is_paneled(t.dtype) ? DType::Q8G : t.dtype;  // one kernel family; the offsets tell q8ga apart
  w.n = int(n);
  w.k = int(k);
  w.group = q8 ? 0 : t.group;
  w.hadamard = t.hadamard;
  w.codes = t.data;
  w.scales = s.data;
  w.scales_f16 = is_paneled(t.dtype) && s.dtype == DType::F16;
  if (o) w.offsets = reinterpret_cast<const float*>(o->data);
  if (w.dtype == DType::Q8G) w.max_code = q8g_code_bound(w.codes, size_t(n) * k);
  return w;
}

int q8g_code_bound(const uint8_t* codes, size_t n) {
  // In chunks, each folded into the largest and smallest code seen as offset-binary bytes (so that SSE2's unsigned
  // byte max/min order them; this file runs before any CPU check, so nothing past SSE2), stopping at the first chunk
  // past 32: a full-range table such as the LM head stops within its first chunk, and only narrow weights are read
  // to the end (Gemma 3 270M's ~100 MB: a plain byte loop added ~0.1 s to opening the model).
  constexpr size_t kChunk = 4096;
  const __m128i flip = _mm_set1_epi8(char(0x80));
  __m128i hi = flip, lo = flip;  // code 0
  uint8_t h = 0x80, l = 0x80;
  for (size_t at = 0; at < n; at += kChunk) {
    const size_t end = std::min(n, at + kChunk);
    size_t i = at;
    for (; i + 16 <= end; i += 16) {
      const __m128i u = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)), flip);
      hi = _mm_max_epu8(hi, u);
      lo = _mm_min_epu8(lo, u);
    }
    for (; i < end; ++i) {
      const uint8_t u = uint8_t(codes[i] ^ 0x80);
      h = std::max(h, u);
      l = std::min(l, u);
    }
    alignas(16) uint8_t his[16], los[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(his), hi);
    _mm_store_si128(reinterpret_cast<__m128i*>(los), lo);
    for (int j = 0; j < 16; ++j) h = std::max(h, his[j]), l = std::min(l, los[j]);
    if (h - 0x80 > 32 || 0x80 - l > 32) return 127;
  }
  if (l >= 0x80 && h <= 0x80 + kQ8gNibbleCodes) return kQ8gNibbleCodes;
  return std::max(h - 0x80, 0x80 - l) <= 16 ? 16 : 32;
}

void gemm(const QAct& a, const QLinear& w, float* y, int ldy, ThreadPool* pool) {
  gemm(a, w, y, ldy, pool, active_backend());
}

// The AMX backend hands int4 GEMMs of up to this many rows (decode batches) to the VNNI kernel: a tile
// multiply always does 16 rows, and every int4 B tile must first be unpacked to int8 in L1, so for a
// few rows the zmm kernel, which dots the nibbles directly, does less work. Measured on a 2-core Xeon
// with AMX (N=6144, K=1536, group 256, 2 threads): VNNI/AMX time 0.73 at 1 row, 0.81 at 4, 0.84 at 8,
// 1.5 at 16.
constexpr int kAmxVnniRowsQ4 = 8;

namespace {

using Kernel = void (*)(const QAct&, const QLinear&, float*, int, int, int);

Kernel pick_kernel(const QAct& a, const QLinear& w, Backend b) {
  if (b == Backend::Vnni) return detail::gemm_vnni;
  if (b == Backend::Amx) {
    if (w.dtype == DType::Q4G && a.m <= kAmxVnniRowsQ4) return detail::gemm_vnni;  // same bits by the kernel contract
    detail::amx_prepare();
    return detail::gemm_amx;
  }
  return detail::gemm_avx2;
}

}  // namespace

void gemm(const QAct& a, const QLinear& w, float* y, int ldy, ThreadPool* pool, Backend b) {
  const GemmTarget t{&w, y, ldy};
  gemm_multi(a, &t, 1, pool, b);
}

void gemm_multi(const QAct& a, const GemmTarget* targets, int n, ThreadPool* pool, Backend b) {
  constexpr int kMaxTargets = 8;
  if (n < 1 || n > kMaxTargets)
    throw std::invalid_argument("gemm_multi: between 1 and " + std::to_string(kMaxTargets) + " targets, got " +
                                std::to_string(n));
  for (int i = 0; i < n; ++i) check_gemm_args(a, *targets[i].w, targets[i].y, targets[i].ldy);
  if (!cpu_supports(b)) throw std::runtime_error(std::string("gemm: this CPU cannot run the ") + backend_name(b) + " backend");
  if (a.m == 0) return;
  // Task t belongs to the target whose range [first[i], first[i + 1]) holds it; a task of target i is tb[i] column
  // blocks (detail::task_blocks).
  Kernel kernel[kMaxTargets];
  int first[kMaxTargets + 1] = {0}, tb[kMaxTargets];
  const int threads = pool ? pool->size() : 1;
  for (int i = 0; i < n; ++i) {
    kernel[i] = pick_kernel(a, *targets[i].w, b);
    const int NB = targets[i].w->n / 16;
    tb[i] = detail::task_blocks(a.m, NB, threads);
    first[i + 1] = first[i] + (NB + tb[i] - 1) / tb[i];
  }
  auto task = [&](int t, int) {
    int i = 0;
    while (t >= first[i + 1]) ++i;
    const GemmTarget& g = targets[i];
    const int NB = g.w->n / 16;
    const int nb0 = (t - first[i]) * tb[i];
    const int nb1 = nb0 + tb[i] < NB ? nb0 + tb[i] : NB;
    kernel[i](a, *g.w, g.y, g.ldy, nb0, nb1);
  };
  detail::run_tasks(pool, first[n], task);
}

}  // namespace sg

namespace sg {

Q8gInput q8g_input_from_name(const std::string& name) {
  if (name == "int8") return Q8gInput::Int8;
  if (name == "f32") return Q8gInput::F32;
  throw std::invalid_argument("q8g activations must be 'int8' or 'f32', got '" + name + "'");
}

const char* q8g_input_name(Q8gInput in) { return in == Q8gInput::Int8 ? "int8" : "f32"; }

void gemm_q8g(const float* x, int ldx, int m, const QLinear& w, float* y, int ldy, ThreadPool* pool, Q8gInput in) {
  gemm_q8g(x, ldx, m, w, y, ldy, pool, active_backend(), in);
}

void gemm_q8g(const float* x, int ldx, int m, const QLinear& w, float* y, int ldy, ThreadPool* pool, Backend b,
              Q8gInput in) {
  const GemmTarget t{&w, y, ldy};
  gemm_q8g_multi(x, ldx, m, &t, 1, pool, b, in);
}

namespace {

// The int8 activations of one gemm_q8g_multi call (gemm.h), in buffers of the calling thread that grow to the
// largest call and are then reused: nothing is allocated per step.
struct Q8gActStore {
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<int32_t> bias16, bias32;
};

// amx: laid out for the AMX kernel (gemm_q8g_int8_panels_amx: rows one after another, padded to whole tiles).
detail::Q8gActs quantize_q8g_input(const float* x, int ldx, int m, int k, Backend b, ThreadPool* pool, bool amx) {
  thread_local Q8gActStore st;
  const bool zmm = b != Backend::Avx2;
  const size_t mk = size_t(m) * k;
  st.codes.resize(amx ? size_t(detail::q8g_amx_padded_rows(m)) * k : mk);
  st.scale.resize(mk / 32);
  st.bias32.resize(mk / 32);
  st.bias16.resize(mk / 16);
  detail::Q8gActs a;
  a.m = m;
  a.k = k;
  a.block_rows = amx ? 1 : detail::q8g_rows_per_block(m, detail::q8g_max_rows(zmm, m));
  // The caller's buffers, by pointer: in a pool thread, `st` would name that thread's own, empty store.
  a.codes = st.codes.data();
  a.scale = st.scale.data();
  a.bias16 = st.bias16.data();
  a.bias32 = st.bias32.data();
  // A decode batch (32 rows of 2048: ~30 µs) is quantised on the calling thread; a prefill chunk over the pool.
  constexpr int kRowsPerTask = 16;
  const int tasks = mk >= (size_t(1) << 17) && pool ? (m + kRowsPerTask - 1) / kRowsPerTask : 1;
  const int rows = tasks == 1 ? m : kRowsPerTask;
  auto task = [&](int t, int) { detail::q8g_quantize_rows(x, ldx, t * rows, std::min(m, (t + 1) * rows), a); };
  detail::run_tasks(tasks > 1 ? pool : nullptr, tasks, task);
  return a;
}

}  // namespace

void gemm_q8g_multi(const float* x, int ldx, int m, const GemmTarget* targets, int n, ThreadPool* pool, Backend b,
                    Q8gInput in) {
  constexpr int kMaxTargets = 8;
  if (n < 1 || n > kMaxTargets)
    throw std::invalid_argument("gemm_q8g_multi: between 1 and " + std::to_string(kMaxTargets) + " targets, got " +
                                std::to_string(n));
  auto bad = [](const std::string& msg) { throw std::invalid_argument("gemm_q8g: " + msg); };
  for (int i = 0; i < n; ++i) {
    const QLinear& w = *targets[i].w;
    if (w.dtype != DType::Q8G) bad("weight dtype must be q8g");
    if (w.n <= 0 || w.n % 16 != 0 || w.k <= 0 || w.group <= 0 || w.k % w.group != 0)
      bad("weight [" + std::to_string(w.n) + ", " + std::to_string(w.k) + "] with group " + std::to_string(w.group) +
          " needs N % 16 == 0 and a group dividing K");
    if (w.k != targets[0].w->k) bad("targets of one call must share K (they read the same x)");
    if (!w.codes || !w.scales) bad("weight without codes or scales");
    if (m > 0 && !targets[i].y) bad("null buffer");
    if (targets[i].ldy < w.n) bad("ldy " + std::to_string(targets[i].ldy) + " < N " + std::to_string(w.n));
  }
  const int K = targets[0].w->k;
  if (m < 0) bad("negative row count");
  if (m > 0 && !x) bad("null buffer");
  if (ldx < K) bad("ldx " + std::to_string(ldx) + " < K " + std::to_string(K));
  if (!cpu_supports(b)) throw std::runtime_error(std::string("gemm_q8g: this CPU cannot run the ") + backend_name(b) +
                                                 " backend");
  if (m == 0) return;
  // q8ga: each row's group sums, once per target for all its N outputs (m·K adds: nothing beside the GEMM), by one
  // routine for every backend (AVX2 is the floor of all of them). One buffer per calling thread.
  thread_local std::vector<float> xsum;
  size_t xsum_at[kMaxTargets], used = 0;
  for (int i = 0; i < n; ++i) {
    xsum_at[i] = used;
    if (targets[i].w->offsets) used += size_t(m) * (K / targets[i].w->group);
  }
  xsum.resize(used);
  float* const sums = xsum.data();  // the caller's buffer: a pool thread's `xsum` would be its own, empty one
  for (int i = 0; i < n; ++i)
    if (targets[i].w->offsets) detail::q8g_group_sums(x, ldx, m, K, targets[i].w->group, sums + xsum_at[i]);
  const auto panels_fn = b == Backend::Avx2 ? detail::gemm_q8g_panels : detail::gemm_q8g_panels_avx512;
  bool int8[kMaxTargets], any_int8 = false;  // per target: int8 activations asked for and its units fit
  for (int i = 0; i < n; ++i)
    any_int8 |= int8[i] = in == Q8gInput::Int8 && q8g_runs_int8(targets[i].w->k, targets[i].w->group);
  // AMX tiles for enough rows, where the tile state holds (no guard: the VNNI kernel gives the same bits).
  const bool amx = any_int8 && b == Backend::Amx && m >= detail::kQ8gAmxMinRows && amx_tiles_usable();
  const auto int8_panels_fn = b == Backend::Avx2 ? detail::gemm_q8g_int8_panels
                              : amx              ? detail::gemm_q8g_int8_panels_amx
                                                 : detail::gemm_q8g_int8_panels_avx512;
  const detail::Q8gActs acts = any_int8 ? quantize_q8g_input(x, ldx, m, K, b, pool, amx) : detail::Q8gActs{};
  // Decode (m <= 32): a multiple of 12 panels a task (a whole number of the kernel's panel blocks for every row
  // count), as many as leave two tasks a thread and at least 12: few task boundaries for the kernels' prefetch (one
  // block ahead) to run past into panels another thread takes, as in gemm_multi (detail::task_blocks). Gemma 3 270M,
  // 12 panels against this, alternated step by step in one process on Zen 5: B=1 0.97-0.98x the step time, B=8
  // 0.91-0.92x, B=32 0.88-1.01x (median of 12-24 pairs, three runs). Prefill:
  // 4 panels, a whole number of the prefill register blocks (4 panels on zmm, 1 on ymm): a 640-column output (o,
  // down) is 40 panels; as 12 + 12 + 12 + 4 the busier of two threads does 24 of them, as ten 4s each does 20. The
  // codes a task walks stay cached while all its row blocks pass, so the smaller task only re-reads x more often
  // (from L2/L3, ~3 GB/s beside the FMAs; measured no slower on one thread at M=256). The targets'
  // tasks form one list, as in gemm_multi: q, k and v (or gate and up) pay one wake-up and one barrier, not one each.
  int first[kMaxTargets + 1] = {0}, tp[kMaxTargets];
  const int threads = pool ? pool->size() : 1;
  for (int i = 0; i < n; ++i) {
    const int panels = targets[i].w->n / 16;
    tp[i] = m > 32 ? 4 : std::max(12, panels / (2 * threads) / 12 * 12);
    first[i + 1] = first[i] + (panels + tp[i] - 1) / tp[i];
  }
  auto task = [&](int t, int) {
    int i = 0;
    while (t >= first[i + 1]) ++i;
    const GemmTarget& g = targets[i];
    const int panels = g.w->n / 16, p0 = (t - first[i]) * tp[i];
    const float* xs = g.w->offsets ? sums + xsum_at[i] : nullptr;
    if (int8[i])
      int8_panels_fn(acts, m, *g.w, xs, g.y, g.ldy, p0, std::min(p0 + tp[i], panels));
    else
      panels_fn(x, ldx, m, *g.w, xs, g.y, g.ldy, p0, std::min(p0 + tp[i], panels));
  };
  detail::run_tasks(pool, first[n], task);
}

}  // namespace sg
