// The scratch layout of the tile attention kernels (attend_rows_avx512.cpp; attend_rows_avx2.cpp, whose tiles are f32
// for every cache type, leaves krows and the bf16 planes unused): which areas they carve from the caller's floats,
// and so how many floats the caller must provide. Plain C++ with internal linkage on purpose (an unnamed namespace):
// the kernels' translation units are compiled with AVX-512 or AVX2 and the callers' (model.cpp, bind_engine.cpp)
// are not, and the Model sizes this scratch on every backend. Each file compiles its own copy with its own flags, so
// the linker can never hand an AVX-512 copy to an AVX2-only CPU (it once did: the sizing function lived in the
// kernel's file and its vpbroadcastq was the first instruction a Zen 3 host could not run).
#pragma once

#include <cstddef>
#include <cstdint>

namespace sg::ops {
namespace {

constexpr int kTile = 64;  // cached positions per K/V tile

// The scratch areas, each 64-byte aligned, carved from the caller's floats in this order. qc, st, wt, qb and wb have
// rows for nv rounded up to 16 (the AMX tiles' 16 vectors; the padding rows of the tiles' inputs stay zero).
struct Scratch {
  uint32_t* qc;    // nv × hd dwords: the query codes (int8: hd/4 dwords used) or f32 values
  float* qscale;   // nv
  int32_t* qcorr;  // nv: 128·Σ codes
  float *m, *l, *alpha;
  float* wscale;  // nv: int8 V, the weight codes' scale (tile maximum / 255)
  float* krows;     // kTile × hd: f16 K rows as f32 before the transpose
  uint32_t* kt;     // hd × kTile dwords (int8: hd/4 × kTile)
  uint32_t* vt;     // kTile × hd dwords (int8: kTile/4 × hd)
  float* ks;        // kTile: per-position K scale (int8)
  float* vs;        // kTile: per-position V scale (int8)
  float* st;        // nv × kTile scores
  uint32_t* wt;     // nv × kTile dwords: f32 weights, or u8 weight quads (int8: the first kTile/4)
  float* o;         // nv × hd output accumulators
  uint16_t* qb;     // the f16 path on bf16 tiles: the queries' three bf16 planes of nv × hd
  uint16_t* wb;     // and the weights' three bf16 planes of nv × kTile
  size_t qb_plane, wb_plane;
  size_t floats;    // the floats carved, from the first 64-byte boundary at or after the base
};

inline size_t align16(size_t n) { return (n + 15) & ~size_t(15); }
inline int round16(int n) { return (n + 15) & ~15; }

// An area of `floats` floats at the cursor (an address, or an offset when only counting), which moves past it.
template <class T>
T* carve(uintptr_t& at, size_t floats) {
  T* r = reinterpret_cast<T*>(at);
  at += align16(floats) * sizeof(float);
  return r;
}

Scratch carve_scratch(float* base, int nv, int hd) {
  const uintptr_t first = (reinterpret_cast<uintptr_t>(base) + 63) & ~uintptr_t(63);
  uintptr_t p = first;
  Scratch s;
  s.qc = carve<uint32_t>(p, size_t(round16(nv)) * hd);
  s.qscale = carve<float>(p, nv);
  s.qcorr = carve<int32_t>(p, nv);
  s.m = carve<float>(p, nv);
  s.l = carve<float>(p, nv);
  s.alpha = carve<float>(p, nv);
  s.wscale = carve<float>(p, nv);
  s.krows = carve<float>(p, size_t(kTile) * hd);
  s.kt = carve<uint32_t>(p, size_t(kTile) * hd);
  s.vt = carve<uint32_t>(p, size_t(kTile) * hd);
  s.ks = carve<float>(p, kTile);
  s.vs = carve<float>(p, kTile);
  s.st = carve<float>(p, size_t(round16(nv)) * kTile);
  s.wt = carve<uint32_t>(p, size_t(round16(nv)) * kTile);
  s.o = carve<float>(p, size_t(nv) * hd);
  s.qb_plane = size_t(round16(nv)) * hd;
  s.wb_plane = size_t(round16(nv)) * kTile;
  s.qb = carve<uint16_t>(p, 3 * s.qb_plane / 2);
  s.wb = carve<uint16_t>(p, 3 * s.wb_plane / 2);
  s.floats = (p - first) / sizeof(float);
  return s;
}

// The floats a caller provides for nv query vectors of hd (ops.h attend_rows_avx512): the areas, and up to 15 more
// for the first 64-byte boundary. The layout is counted from base 0, where no pointer is ever formed into memory.
inline size_t attend_rows_scratch_floats(int nv, int hd) { return 16 + carve_scratch(nullptr, nv, hd).floats; }

}  // namespace
}  // namespace sg::ops
