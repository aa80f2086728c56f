// Python access to the kernels, for their unit tests and benchmarks (splitgemma._native.kernels).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fgm_file.h"
#include "gemm.h"
#include "probes.h"

namespace py = pybind11;

namespace {

using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <class T>
using AlignedPtr = std::unique_ptr<T[], FreeDeleter>;

template <class T>
AlignedPtr<T> aligned_array(size_t count) {
  const size_t bytes = (count * sizeof(T) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes ? bytes : 64);
  if (!p) throw std::bad_alloc();
  return AlignedPtr<T>(static_cast<T*>(p));
}

// Caller-owned QAct storage for m × k activations.
struct QActStore {
  AlignedPtr<int8_t> packed;
  AlignedPtr<float> scale;
  AlignedPtr<int32_t> rowsum;
  sg::QAct q;
  QActStore(int m, int k)
      : packed(aligned_array<int8_t>(sg::qact_packed_bytes(m, k))),
        scale(aligned_array<float>(sg::qact_padded_rows(m))),
        rowsum(aligned_array<int32_t>(sg::qact_rowsum_count(m, k))) {
    // Zeroed once: the quantiser leaves padding rows' codes as they are, and the kernels read them along (gemm.h).
    std::memset(packed.get(), 0, sg::qact_packed_bytes(m, k));
    q.packed = packed.get();
    q.scale = scale.get();
    q.rowsum = rowsum.get();
  }
};

sg::Backend pick_backend(const std::optional<std::string>& name) {
  return name ? sg::backend_from_name(name->c_str()) : sg::active_backend();
}

// The activation quantiser of a backend's instruction set, as the engine picks it (model.cpp): zmm on VNNI/AMX.
using QuantizeFn = void (*)(const float*, int, int, int, int, sg::QAct*, sg::ThreadPool*);
QuantizeFn quantizer_for(sg::Backend b) {
  if (b == sg::Backend::Avx2) return sg::quantize_activations;
  if (!sg::cpu_supports(b))
    throw std::runtime_error(std::string("quantize: this CPU cannot run the ") + sg::backend_name(b) + " backend");
  return sg::quantize_activations_avx512;
}

const F32Array& check_rows(const F32Array& x, int k, const char* what) {
  if (x.ndim() != 2) throw std::invalid_argument(std::string(what) + ": x must be 2-D [M, K]");
  if (x.shape(1) != k)
    throw std::invalid_argument(std::string(what) + ": x has " + std::to_string(x.shape(1)) + " columns, the weight K is " +
                                std::to_string(k));
  return x;
}

// Quantise x and run one GEMM on a pool of `threads` workers.
py::array_t<float> run_linear(const F32Array& x, const sg::QLinear& w, sg::Backend b, int threads, sg::Q8gInput in) {
  check_rows(x, w.k, "linear");
  if (threads < 1) throw std::invalid_argument("linear: threads must be >= 1");
  const int m = int(x.shape(0));
  // On cache lines, as the engine's buffers are (the AMX kernel streams large outputs to aligned rows only).
  float* yp = aligned_array<float>(size_t(m) * w.n).release();
  py::array_t<float> y({py::ssize_t(m), py::ssize_t(w.n)}, yp, py::capsule(yp, [](void* p) { std::free(p); }));
  const float* xp = x.data();
  {
    py::gil_scoped_release nogil;
    QActStore qa(m, w.k);
    sg::backend_thread_init();
    sg::ThreadPool pool(threads, sg::backend_thread_init);
    if (w.dtype == sg::DType::Q8G) {  // the q8g GEMM quantises (int8 input) or not (f32) itself
      sg::gemm_q8g(xp, w.k, m, w, yp, w.n, &pool, b, in);
    } else {
      quantizer_for(b)(xp, w.k, m, w.k, w.hadamard, &qa.q, &pool);
      sg::gemm(qa.q, w, yp, w.n, &pool, b);
    }
  }
  return y;
}

sg::QLinear qlinear_from_arrays(const py::array& codes, const py::array& scales, const std::string& dtype, int n, int k,
                                int group, int hadamard, int copies = 1) {
  auto bad = [](const std::string& m) { throw std::invalid_argument("linear_packed: " + m); };
  sg::QLinear w;
  if (dtype == "q8c") w.dtype = sg::DType::Q8C;
  else if (dtype == "q4g") w.dtype = sg::DType::Q4G;
  else if (dtype == "q8g") w.dtype = sg::DType::Q8G;
  else bad("dtype must be 'q8c', 'q4g' or 'q8g'");
  const bool q8 = w.dtype == sg::DType::Q8C, q8g = w.dtype == sg::DType::Q8G;
  if (n <= 0 || n % 16 || k <= 0 || (!q8g && k % 64)) bad("needs N % 16 == 0 and K % 64 == 0 (q8g: any K)");
  if (w.dtype == sg::DType::Q4G && (group <= 0 || group % 64 || k % group)) bad("group must be a multiple of 64 dividing K");
  if (q8g && (group <= 0 || k % group)) bad("q8g group must be a positive divisor of K");
  if (hadamard != 0 && (q8g || hadamard != 128 || k % 128))
    bad("hadamard must be 0, or 128 with K % 128 == 0 (q8g: always 0)");
  if (copies < 1) bad("copies must be >= 1");
  const size_t code_bytes = (w.dtype == sg::DType::Q4G ? size_t(n) * k / 2 : size_t(n) * k) * copies;
  if (codes.itemsize() != 1 || !(codes.flags() & py::array::c_style) || size_t(codes.nbytes()) != code_bytes)
    bad("codes must be a contiguous byte array of " + std::to_string(code_bytes) + " bytes");
  const size_t n_scales = (q8 ? size_t(n) : size_t(k / group) * n) * copies;
  const char kind = scales.dtype().kind();
  const size_t scale_size = w.dtype == sg::DType::Q4G ? 2 : 4;
  // q8g: float32 or float16 scales (QLinear::scales_f16)
  const bool dt_ok = kind == 'f' && (size_t(scales.itemsize()) == scale_size || (q8g && scales.itemsize() == 2));
  if (!dt_ok || !(scales.flags() & py::array::c_style) || size_t(scales.size()) != n_scales)
    bad(std::string("scales must be a contiguous ") +
        (q8 ? "float32 [N]" : q8g ? "float32 or float16 [K/group, N]" : "float16 [K/group, N]") + " array" +
        (copies > 1 ? " per copy" : ""));
  w.n = n;
  w.k = k;
  w.group = q8 ? 0 : group;
  w.hadamard = hadamard;
  w.codes = static_cast<const uint8_t*>(codes.data());
  w.scales = scales.data();
  w.scales_f16 = q8g && scales.itemsize() == 2;
  if (q8g) w.max_code = sg::q8g_code_bound(w.codes, code_bytes);  // as qlinear_from does for a file's weight
  return w;
}

}  // namespace

void bind_kernels(py::module_& parent) {
  py::module_ m = parent.def_submodule("kernels", "Quantised GEMM kernels, activation quantisation, Hadamard transform");

  m.def(
      "cpu_supports", [](const std::string& name) { return sg::cpu_supports(sg::backend_from_name(name.c_str())); },
      py::arg("name"), "Whether this CPU can run the backend 'amx', 'vnni' or 'avx2'.");
  m.def("amx_tiles_usable", &sg::amx_tiles_usable,
        "Whether AMX tiles may be used beside the GEMMs (the amx backend's prefill attention): AMX here and the "
        "tile-state guard off.");
  m.def("amx_bf16_tiles_usable", &sg::amx_bf16_tiles_usable,
        "amx_tiles_usable() and the CPU has AMX-BF16: the amx backend's f16 K/V attention then runs on bf16 tiles.");
  m.def(
      "active_backend", [] { return std::string(sg::backend_name(sg::active_backend())); },
      "The backend gemm() uses by default (FGM_BACKEND or the best the CPU has).");

  m.def("q8g_runs_int8", &sg::q8g_runs_int8, py::arg("k"), py::arg("group"),
        "Whether a q8g weight of K inputs and this group runs on int8 activations when the engine's q8g_input is "
        "int8 (group 16 or a multiple of 32, K % 32 == 0); otherwise it keeps f32 activations.");
  m.def(
      "q8g_code_bound",
      [](const py::array_t<int8_t, py::array::c_style>& codes) {
        return sg::q8g_code_bound(reinterpret_cast<const uint8_t*>(codes.data()), size_t(codes.size()));
      },
      py::arg("codes"),
      "15 when every one of these q8g codes lies in 0..15, else 16 or 32 when that bounds every |code|, else 127: what "
      "the engine records for a q8g weight (QLinear::max_code), below 127 of which the AVX2 int8 kernel runs without "
      "the sign trick (at 15 on the codes themselves).");

  m.def(
      "fwht128",
      [](const F32Array& x) {
        py::array_t<float> out(x.request().shape);
        std::memcpy(out.mutable_data(), x.data(), sizeof(float) * x.size());
        sg::fwht128(out.mutable_data(), int(x.size()));
        return out;
      },
      py::arg("x"), "Normalised Walsh–Hadamard transform of every contiguous 128-block (returns a new array).");

  m.def(
      "quantize_rows",
      [](const F32Array& x, int hadamard, const std::optional<std::string>& backend, bool via_source) {
        if (x.ndim() != 2) throw std::invalid_argument("quantize_rows: x must be 2-D [M, K]");
        const int mr = int(x.shape(0)), k = int(x.shape(1));
        if (k % 64 != 0) throw std::invalid_argument("quantize_rows: K must be a multiple of 64");
        const sg::Backend b = backend ? sg::backend_from_name(backend->c_str()) : sg::Backend::Avx2;
        const QuantizeFn quantize = quantizer_for(b);
        QActStore qa(mr, k);
        if (via_source) {  // the rows through a RowSource that copies them (quantize_activations_from)
          struct Ctx {
            const float* x;
            int k;
          } ctx{x.data(), k};
          const sg::RowSource src{[](const void* c, int r, float* row) {
                                    const Ctx& cx = *static_cast<const Ctx*>(c);
                                    std::memcpy(row, cx.x + size_t(r) * cx.k, sizeof(float) * cx.k);
                                  },
                                  &ctx};
          sg::ThreadPool pool(2);
          (b == sg::Backend::Avx2 ? sg::quantize_activations_from : sg::quantize_activations_from_avx512)(
              src, mr, k, hadamard, &qa.q, &pool);
        } else {
          quantize(x.data(), k, mr, k, hadamard, &qa.q, nullptr);
        }
        // Unpack the tile layout into plain rows (the layout itself is what gemm() reads).
        py::array_t<int8_t> codes({py::ssize_t(mr), py::ssize_t(k)});
        py::array_t<float> scale(py::ssize_t{mr});
        const int KB = k / 64;
        for (int r = 0; r < mr; ++r) {
          for (int kb = 0; kb < KB; ++kb)
            std::memcpy(codes.mutable_data() + size_t(r) * k + kb * 64,
                        qa.q.packed + ((size_t(r / 16) * KB + kb) * 16 + r % 16) * 64, 64);
          scale.mutable_data()[r] = qa.q.scale[r];
        }
        return py::make_tuple(codes, scale);
      },
      py::arg("x"), py::arg("hadamard") = 0, py::arg("backend") = py::none(), py::arg("via_source") = false,
      "Per-row int8 quantisation exactly as gemm() sees it: (codes int8[M,K], scale f32[M]); with the ymm quantiser, "
      "or the one the named backend's engine uses (vnni/amx: zmm); via_source: the rows handed over one by one "
      "through a RowSource on a 2-thread pool (quantize_activations_from).");

  m.def(
      "linear",
      [](const F32Array& x, std::shared_ptr<sg::FgmFile> f, const std::string& tensor,
         const std::optional<std::string>& backend, int threads, const std::string& q8g_input) {
        const sg::QLinear w = sg::qlinear_from(*f, f->require(tensor));
        return run_linear(x, w, pick_backend(backend), threads, sg::q8g_input_from_name(q8g_input));
      },
      py::arg("x"), py::arg("fgm"), py::arg("tensor"), py::arg("backend") = py::none(), py::arg("threads") = 1,
      py::arg("q8g_input") = "f32",
      "y = x · Wᵀ for a q8c/q4g linear of an .fgm file (quantise + GEMM), or a q8g one (q8g_input 'f32': "
      "weight-only; 'int8': x quantised in blocks of 32, gemm.h).");

  m.def(
      "linear_packed",
      [](const F32Array& x, const py::array& codes, const py::array& scales, const std::string& dtype, int n, int k,
         int group, int hadamard, const std::optional<std::string>& backend, int threads,
         const std::optional<F32Array>& offsets, const std::string& q8g_input) {
        sg::QLinear w = qlinear_from_arrays(codes, scales, dtype, n, k, group, hadamard);
        const sg::Q8gInput in = sg::q8g_input_from_name(q8g_input);
        if (offsets) {  // q8ga: the offsets in the scales' layout
          if (w.dtype != sg::DType::Q8G || size_t(offsets->size()) != size_t(k / group) * n)
            throw std::invalid_argument("linear_packed: offsets (q8ga) need dtype 'q8g' and float32 [K/group, N]");
          w.offsets = offsets->data();
        }
        return run_linear(x, w, pick_backend(backend), threads, in);
      },
      py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("dtype"), py::arg("n"), py::arg("k"),
      py::arg("group") = 0, py::arg("hadamard") = 0, py::arg("backend") = py::none(), py::arg("threads") = 1,
      py::arg("offsets") = py::none(), py::arg("q8g_input") = "f32",
      "y = x · Wᵀ for a weight given as codes + scales (+ offsets: q8ga) in the .fgm byte layout (q8c/q4g tiles, "
      "q8g panels). q8g_input: the q8g GEMM's activations, 'f32' (weight-only) or 'int8' (gemm.h).");

  m.def(
      "bench_linear",
      [](const F32Array& x, const py::array& codes, const py::array& scales, const std::string& dtype, int n, int k,
         int group, int hadamard, const std::optional<std::string>& backend, int threads, int repeats, int copies,
         const std::string& q8g_input) {
        // codes/scales hold `copies` weights back to back; call i uses copy i % copies, so a
        // set larger than the caches measures streaming from DRAM.
        const sg::QLinear w0 = qlinear_from_arrays(codes, scales, dtype, n, k, group, hadamard, copies);
        const sg::Backend b = pick_backend(backend);
        const sg::Q8gInput in = sg::q8g_input_from_name(q8g_input);
        check_rows(x, k, "bench_linear");
        if (threads < 1 || repeats < 1) throw std::invalid_argument("bench_linear: threads and repeats must be >= 1");
        const int mr = int(x.shape(0));
        const bool q8g = w0.dtype == sg::DType::Q8G;
        const size_t code_bytes = w0.dtype == sg::DType::Q4G ? size_t(n) * k / 2 : size_t(n) * k;
        const size_t scale_bytes = w0.dtype == sg::DType::Q8C ? size_t(n) * 4
                                   : q8g                     ? size_t(k / group) * n * (w0.scales_f16 ? 2 : 4)
                                                             : size_t(k / group) * n * 2;
        std::vector<double> times;
        {
          py::gil_scoped_release nogil;
          QActStore qa(mr, k);
          auto y = aligned_array<float>(size_t(mr) * n);
          sg::backend_thread_init();
          sg::ThreadPool pool(threads, sg::backend_thread_init);
          if (!q8g) sg::quantize_activations(x.data(), k, mr, k, hadamard, &qa.q, &pool);
          for (int r = 0; r < repeats; ++r) {
            sg::QLinear w = w0;
            w.codes += code_bytes * (r % copies);
            w.scales = static_cast<const uint8_t*>(w0.scales) + scale_bytes * (r % copies);
            const auto t0 = std::chrono::steady_clock::now();
            if (q8g) sg::gemm_q8g(x.data(), k, mr, w, y.get(), n, &pool, b, in);
            else sg::gemm(qa.q, w, y.get(), n, &pool, b);
            times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
          }
        }
        return times;
      },
      py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("dtype"), py::arg("n"), py::arg("k"), py::arg("group") = 0,
      py::arg("hadamard") = 0, py::arg("backend") = py::none(), py::arg("threads") = 1, py::arg("repeats") = 10,
      py::arg("copies") = 1, py::arg("q8g_input") = "f32",
      "Seconds per gemm() call (activations quantised once, outside the timing; a q8g GEMM with int8 input "
      "quantises inside it, as in the engine).");

  m.def(
      "bench_quantize",
      [](const F32Array& x, int hadamard, int threads, int repeats, const std::optional<std::string>& backend) {
        if (x.ndim() != 2) throw std::invalid_argument("bench_quantize: x must be 2-D [M, K]");
        const int mr = int(x.shape(0)), k = int(x.shape(1));
        const QuantizeFn quantize = quantizer_for(backend ? sg::backend_from_name(backend->c_str()) : sg::Backend::Avx2);
        std::vector<double> times;
        py::gil_scoped_release nogil;
        QActStore qa(mr, k);
        sg::ThreadPool pool(threads);
        for (int r = 0; r < repeats; ++r) {
          const auto t0 = std::chrono::steady_clock::now();
          quantize(x.data(), k, mr, k, hadamard, &qa.q, &pool);
          times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        return times;
      },
      py::arg("x"), py::arg("hadamard") = 0, py::arg("threads") = 1, py::arg("repeats") = 10,
      py::arg("backend") = py::none(), "Seconds per quantize_activations() call (ymm, or the backend's quantiser).");

  m.def(
      "peak_tops",
      [](const std::string& backend, int threads, double seconds) {
        const sg::Backend b = sg::backend_from_name(backend.c_str());
        py::gil_scoped_release nogil;
        sg::ThreadPool pool(threads, sg::backend_thread_init);
        return sg::peak_tops(b, &pool, seconds);
      },
      py::arg("backend"), py::arg("threads") = 1, py::arg("seconds") = 0.2,
      "int8 TOPS of the backend's multiply-accumulate instruction back to back on `threads` threads.");

  m.def(
      "amx_tile_loop_tops",
      [](const std::string& in_l1, int threads, double seconds) {
        static const char* names[] = {"none", "activations", "weights", "both"};
        int which = -1;
        for (int i = 0; i < 4; ++i)
          if (in_l1 == names[i]) which = i;
        if (which < 0)
          throw std::invalid_argument("amx_tile_loop_tops: in_l1 must be none, activations, weights or both, got '" +
                                      in_l1 + "'");
        py::gil_scoped_release nogil;
        sg::ThreadPool pool(threads, sg::backend_thread_init);
        return sg::amx_tile_loop_tops(which, &pool, seconds);
      },
      py::arg("in_l1"), py::arg("threads") = 1, py::arg("seconds") = 0.2,
      "int8 TOPS of the AMX q8c kernel's 2x2 tile loop alone (a 256-row chunk against one task's 64 columns at "
      "K=1536, no epilogue) on `threads` threads, its operands from L2 except those in_l1 names: 'none', "
      "'activations', 'weights' or 'both'. RuntimeError without AMX.");

  m.def(
      "peak_f32_gflops",
      [](int threads, double seconds, const std::optional<std::string>& backend) {
        const sg::Backend b = pick_backend(backend);
        py::gil_scoped_release nogil;
        sg::ThreadPool pool(threads);
        return sg::peak_f32_gflops(b, &pool, seconds);
      },
      py::arg("threads") = 1, py::arg("seconds") = 0.2, py::arg("backend") = py::none(),
      "f32 GFLOP/s of the backend's FMAs (ymm on avx2, zmm on vnni/amx) back to back on `threads` threads: the "
      "limit of the weight-only q8g GEMM.");

  m.def(
      "read_bandwidth",
      [](size_t bytes, int threads, int passes, std::optional<py::buffer> of) {
        std::optional<py::buffer_info> info;
        if (of) {
          info = of->request();
          if (!PyBuffer_IsContiguous(info->view(), 'C'))
            throw std::invalid_argument("read_bandwidth: the buffer must be contiguous");
          const size_t have = size_t(info->size) * size_t(info->itemsize);
          if (bytes > have)
            throw std::invalid_argument("read_bandwidth: " + std::to_string(bytes) + " bytes asked of a buffer of " +
                                        std::to_string(have));
        }
        py::gil_scoped_release nogil;
        sg::ThreadPool pool(threads);
        return info ? sg::read_bandwidth_gbs(info->ptr, bytes, &pool, passes)
                    : sg::read_bandwidth_gbs(bytes, &pool, passes);
      },
      py::arg("bytes"), py::arg("threads") = 1, py::arg("passes") = 3, py::arg("of") = py::none(),
      "Streaming read bandwidth in GB/s (1e9 B/s) of `threads` threads reading a fresh `bytes`-long buffer, or the "
      "first `bytes` of the buffer `of` as they are (e.g. a mapped weight file: its pages wherever the page cache put "
      "them): a list of `passes` readings, one per pass.");

  m.def(
      "tile_guard_status",
      [] {
        const sg::TileGuardStatus s = sg::amx_tile_guard_status();
        py::dict d;
        d["enabled"] = s.enabled;
        d["recoveries"] = s.recoveries;
        return d;
      },
      "AMX tile-state guard: enabled (-1 undecided, 0, 1) and blocks recomputed after a tile-state loss.");
}
