// Quantised GEMM on the .fgm's tile-ordered weights, on three backends that read the same
// bytes: AMX (Intel AMX-INT8 tiles), VNNI (AVX-512 VNNI) and AVX2 (any x86-64 with AVX2,
// e.g. AMD EPYC; the portable floor).
//
// Contract: y[m, n] = sum_k x[m, k] * W[n, k] (f32 out), where x is given as f32 rows and is
// Hadamard-rotated (when the weight is) and quantised to int8 per row once by
// quantize_activations(); every GEMM sharing that input reuses the QAct.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fgm_file.h"
#include "threadpool.h"

namespace sg {

enum class Backend : int { Avx2 = 0, Vnni = 1, Amx = 2 };

// Decided once per process from FGM_BACKEND (amx|vnni|avx2) or CPUID (+ the AMX tile
// permission grant); printed once to stderr. Throws std::runtime_error when FGM_BACKEND asks
// for an instruction set this CPU lacks.
Backend active_backend();
const char* backend_name(Backend b);
bool cpu_supports(Backend b);
// Per-thread set-up the backend needs (AMX: ARCH_REQ_XCOMP_PERM). Safe to call repeatedly.
void backend_thread_init();

// A linear weight as stored in the file (q8c or q4g, tile order).
struct QLinear {
  DType dtype = DType::Q8C;
  int n = 0, k = 0;
  int group = 0;     // q4g scale group along K
  int hadamard = 0;  // 128: the input must be rotated
  const uint8_t* codes = nullptr;
  const void* scales = nullptr;  // f32[n] (q8c) or f16[k/group][n] (q4g)
};
QLinear qlinear_from(const FgmFile& f, const TensorInfo& t);

// Activations quantised per row to int8 (after the Hadamard transform when hadamard > 0),
// packed in the layout the backend's kernels read. Buffers are caller-owned and sized by
// qact_bytes(); nothing is allocated per call.
struct QAct {
  int m = 0, k = 0;
  int hadamard = 0;
  int8_t* packed = nullptr;  // backend layout
  float* scale = nullptr;    // [m_padded] per-row dequantisation scale
  int32_t* rowsum = nullptr; // [m_padded][k/64] per-row, per-64-block code sums (VNNI/AVX2 bias correction)
};
size_t qact_packed_bytes(int m, int k);
size_t qact_rowsum_count(int m, int k);
int qact_padded_rows(int m);

void quantize_activations(const float* x, int ldx, int m, int k, int hadamard, QAct* out, ThreadPool* pool);

// y[m, n] (row stride ldy) = dequantised x · Wᵀ. a.hadamard must equal w.hadamard.
void gemm(const QAct& a, const QLinear& w, float* y, int ldy, ThreadPool* pool);

// In-place normalised fast Walsh–Hadamard transform of every contiguous 128-block of x[0..n).
void fwht128(float* x, int n);

}  // namespace sg
