// Python access to the engine: Model (prefill, batched decode), KvArena (slots in a caller's buffer), sample(),
// RowSampler + sample_rows() (one sequence's logits processing and sampling; a decode step's rows in one call).
// The GIL is released during compute; arguments are validated first and bad ones raise ValueError / IndexError /
// TypeError with the reason (docs/engine-api.md).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attend_rows_scratch.h"
#include "kv_layout.h"
#include "model.h"
#include "ops.h"
#include "row_sampler.h"
#include "sampling.h"

namespace py = pybind11;

namespace {

using F32Vec = py::array_t<float, py::array::c_style | py::array::forcecast>;

// A KvArena over a Python buffer; holds the buffer export (so a bytearray cannot be resized nor an mmap closed
// while the arena exists) and the Model whose layout it uses.
struct PyKvArena {
  std::shared_ptr<sg::Model> model;
  Py_buffer view{};
  bool has_view = false;
  std::unique_ptr<sg::KvArena> arena;

  PyKvArena(std::shared_ptr<sg::Model> m, py::object buffer, int n_slots) : model(std::move(m)) {
    if (PyObject_GetBuffer(buffer.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
      py::error_already_set e;
      throw py::value_error(std::string("KvArena needs a writable, C-contiguous buffer (bytearray, mmap, numpy "
                                        "array): ") + e.what());
    }
    has_view = true;
    arena = std::make_unique<sg::KvArena>(model->kv_layout(), static_cast<uint8_t*>(view.buf), size_t(view.len),
                                          n_slots);
  }
  ~PyKvArena() {
    if (has_view) PyBuffer_Release(&view);
  }
  PyKvArena(const PyKvArena&) = delete;
  PyKvArena& operator=(const PyKvArena&) = delete;
};

// A 1-D sequence of integers (list, tuple, integer numpy array) as int32, with a precise error otherwise.
std::vector<int32_t> int_vector(const py::handle& obj, const char* name) {
  py::module_ np = py::module_::import("numpy");
  py::array arr = np.attr("asarray")(obj);
  if (arr.ndim() != 1) throw py::value_error(std::string(name) + " must be a 1-D sequence of integers");
  std::vector<int32_t> out;
  if (arr.size() == 0) return out;
  const char kind = arr.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw py::type_error(std::string(name) + " must hold integers, got dtype " + std::string(py::str(arr.dtype())));
  auto a64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
  if (kind == 'u' && arr.dtype().itemsize() == 8) {
    // uint64 values >= 2^63 would wrap when viewed as int64.
    auto u = py::array_t<uint64_t, py::array::c_style>::ensure(arr);
    for (py::ssize_t i = 0; i < u.size(); ++i)
      if (u.data()[i] > uint64_t(INT32_MAX))
        throw py::index_error(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(u.data()[i]) +
                              " is out of range");
  }
  out.resize(a64.size());
  for (py::ssize_t i = 0; i < a64.size(); ++i) {
    const int64_t v = a64.data()[i];
    if (v < INT32_MIN || v > INT32_MAX)
      throw py::index_error(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(v) + " is out of range");
    out[i] = int32_t(v);
  }
  return out;
}

int int_arg(int64_t v, const char* name) {
  if (v < INT32_MIN || v > INT32_MAX) throw py::index_error(std::string(name) + " = " + std::to_string(v) + " is out of range");
  return int(v);
}

py::dict header_dict(const sg::KvArena& a, int slot) {
  a.check_slot(slot);
  const sg::SlotHeader* h = a.header(slot);
  py::dict d;
  d["valid"] = a.header_matches(slot);
  d["n_tokens"] = a.n_tokens(slot);
  d["request_id"] = h->request_id;
  d["generation"] = h->generation;
  d["lease_digest"] = py::bytes(reinterpret_cast<const char*>(h->lease_digest), sg::kLeaseDigestBytes);
  d["sealed"] = bool(h->flags & sg::kSlotSealed) && a.header_matches(slot);
  d["checksum"] = h->checksum;
  d["model_signature"] = h->model_signature;
  d["max_context"] = h->max_context;
  d["chunk"] = h->chunk;
  d["kv_dtype"] = sg::kv_dtype_name(sg::KvDtype((h->flags >> 8) & 0xFF));
  return d;
}

py::dict layout_dict(const sg::KvLayout& L) {
  py::dict d;
  d["slot_bytes"] = L.slot_bytes();
  d["position_bytes"] = L.position_bytes();
  d["header_bytes"] = sizeof(sg::SlotHeader);
  d["max_context"] = L.max_context();
  d["chunk"] = L.chunk();
  d["sliding_window"] = L.sliding_window();
  d["model_signature"] = L.model_signature();
  d["kv_dtype"] = sg::kv_dtype_name(L.dtype());
  py::list layers;
  for (int i = 0; i < L.num_layers(); ++i) {
    const sg::KvLayerLayout& l = L.layer(i);
    if (l.layer < 0) continue;
    py::dict e;
    e["layer"] = l.layer;
    e["cap"] = l.cap;
    e["row_bytes"] = l.row_bytes;
    e["k_off"] = l.k_off;
    e["v_off"] = l.v_off;
    e["ks_off"] = l.ks_off;
    e["vs_off"] = l.vs_off;
    layers.append(e);
  }
  d["layers"] = layers;
  return d;
}

uint64_t rng_arg(const py::handle& v) {
  if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v))
    throw py::type_error("rng_state must be an int in [0, 2**64)");
  const unsigned long long s = PyLong_AsUnsignedLongLong(v.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error("rng_state must be an int in [0, 2**64)");
  }
  return uint64_t(s);
}

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<sg::Model, std::shared_ptr<sg::Model>>(
      m, "Model", "The Gemma 4 forward pass over a .fgm file: prefill and batched decode into KV slots.")
      .def(py::init([](py::object path, py::object threads, int max_context, int chunk, int max_batch,
                       py::object weights, py::object backend, py::object kv_dtype, py::object q8g_input) {
             const std::string p = py::str(py::module_::import("os").attr("fspath")(path));
             sg::ModelOptions o;
             if (!threads.is_none()) {
               o.threads = threads.cast<int>();
               if (o.threads < 1) throw py::value_error("threads must be a positive integer or None");
             }
             o.max_context = max_context;
             o.chunk = chunk;
             o.max_batch = max_batch;
             if (!weights.is_none()) o.weights = weights.cast<std::string>();
             if (!backend.is_none()) o.backend = backend.cast<std::string>();
             if (!kv_dtype.is_none()) o.kv_dtype = kv_dtype.cast<std::string>();
             if (!q8g_input.is_none()) o.q8g_input = q8g_input.cast<std::string>();
             py::gil_scoped_release nogil;
             return std::make_shared<sg::Model>(std::make_shared<sg::FgmFile>(p), o);
           }),
           py::arg("path"), py::arg("threads") = py::none(), py::arg("max_context") = 4096, py::arg("chunk") = 256,
           py::arg("max_batch") = 8, py::arg("weights") = py::none(), py::arg("backend") = py::none(),
           py::arg("kv_dtype") = py::none(), py::arg("q8g_input") = py::none(),
           "Open a .fgm file. threads: pool size (None: FGM_THREADS or all CPUs); max_context: longest sequence a "
           "KV slot holds; chunk: prefill rows per pass (also the sliding rings' headroom); max_batch: decode rows "
           "per pass; weights: int4 | int8 | auto:M (None: FGM_WEIGHTS or auto:16); backend: amx | vnni | avx2 (None: the process "
           "default, FGM_BACKEND or CPUID); kv_dtype: int8 | f16 | f32, the K/V cache element type (None: what the file's "
           "config asks for, else int8); q8g_input: int8 | f32, the activations of the q8g GEMMs (None: "
           "FGM_Q8G_INPUT, else int8 on the vnni and amx backends and f32 on avx2; f32 is the weight-only path that "
           "keeps the GGUF models' fidelity to float32).")
      .def_property_readonly("path", [](const sg::Model& md) { return md.file().path(); })
      .def_property_readonly("vocab_size", [](const sg::Model& md) { return md.config().vocab_size; })
      .def_property_readonly("hidden_size", [](const sg::Model& md) { return md.config().hidden_size; })
      .def_property_readonly("num_layers", [](const sg::Model& md) { return md.config().num_layers; })
      .def_property_readonly("max_context", [](const sg::Model& md) { return md.kv_layout().max_context(); })
      .def_property_readonly("chunk", &sg::Model::chunk)
      .def_property_readonly("max_rows", &sg::Model::max_rows)
      .def_property_readonly("threads", &sg::Model::threads)
      .def_property(
          "weights", [](const sg::Model& md) { return md.weight_policy().str(); },
          [](sg::Model& md, const std::string& spec) {
            py::gil_scoped_release nogil;  // waits for a pass running on another thread
            md.set_weight_policy(spec);
          },
          "the FFN weight policy (int4 | int8 | auto:M); settable between passes")
      .def_property_readonly("backend", [](const sg::Model& md) { return sg::backend_name(md.backend()); })
      .def_property_readonly("q8g_input", [](const sg::Model& md) { return sg::q8g_input_name(md.q8g_input()); })
      .def_property_readonly("layout_signature", [](const sg::Model& md) { return md.file().layout_signature(); })
      .def_property_readonly("kv_slot_bytes", [](const sg::Model& md) { return md.kv_layout().slot_bytes(); })
      .def_property_readonly("kv_layout", [](const sg::Model& md) { return layout_dict(md.kv_layout()); })
      .def(
          "prefill",
          [](sg::Model& md, PyKvArena& a, int64_t slot, py::object tokens, int64_t pos0, bool all_logits) {
            const std::vector<int32_t> t = int_vector(tokens, "tokens");
            const int s = int_arg(slot, "slot"), p0 = int_arg(pos0, "pos0");
            const int V = md.config().vocab_size;
            // Validate before allocating a possibly large [T, V] result.
            md.check_prefill(*a.arena, s, t.data(), int(t.size()), p0);
            py::array_t<float> out = all_logits ? py::array_t<float>({py::ssize_t(t.size()), py::ssize_t(V)})
                                                : py::array_t<float>({py::ssize_t(V)});
            float* o = out.mutable_data();
            {
              py::gil_scoped_release nogil;
              md.prefill(*a.arena, s, t.data(), int(t.size()), p0, all_logits, o);
            }
            return out;
          },
          py::arg("arena"), py::arg("slot"), py::arg("tokens"), py::arg("pos0") = 0, py::arg("all_logits") = false,
          "Run tokens at positions pos0.. into the slot. Returns float32 logits [V] of the last token, or [T, V] "
          "with all_logits.")
      .def(
          "decode",
          [](sg::Model& md, PyKvArena& a, py::object slots, py::object tokens, py::object positions,
             py::object logits, py::object out_buffer, py::object prefixes) {
            const std::vector<int32_t> s = int_vector(slots, "slots"), t = int_vector(tokens, "tokens"),
                                       p = int_vector(positions, "positions");
            if (s.size() != t.size() || s.size() != p.size())
              throw py::value_error("slots, tokens and positions must have the same length (got " +
                                    std::to_string(s.size()) + ", " + std::to_string(t.size()) + ", " +
                                    std::to_string(p.size()) + ")");
            if (s.empty()) throw py::value_error("decode needs at least one sequence");
            std::vector<sg::DecodeRow> rows(s.size());
            for (size_t i = 0; i < s.size(); ++i) rows[i] = sg::DecodeRow{s[i], t[i], p[i], true};
            if (!logits.is_none()) {
              py::array arr = py::module_::import("numpy").attr("asarray")(logits);
              if (arr.ndim() != 1 || size_t(arr.size()) != s.size() || arr.dtype().kind() != 'b')
                throw py::value_error("logits must be one bool per token (" + std::to_string(s.size()) + " tokens)");
              auto want = py::array_t<bool, py::array::c_style | py::array::forcecast>::ensure(arr);
              for (size_t i = 0; i < s.size(); ++i) rows[i].logits = want.data()[i];
            }
            if (!prefixes.is_none()) {
              const py::sequence seq = prefixes.cast<py::sequence>();
              if (size_t(py::len(seq)) != s.size())
                throw py::value_error("prefixes must hold one entry per token (" + std::to_string(s.size()) +
                                      " tokens), got " + std::to_string(py::len(seq)));
              for (size_t i = 0; i < s.size(); ++i) {
                const py::object e = seq[i];
                if (e.is_none()) continue;
                const auto bad = [&] {
                  return py::value_error("prefixes[" + std::to_string(i) +
                                         "] must be None or a pair of integers (prefix_slot, prefix_len), got " +
                                         std::string(py::repr(e)));
                };
                if (!py::isinstance<py::sequence>(e) || py::isinstance<py::str>(e) || py::len(e) != 2) throw bad();
                try {
                  rows[i].prefix_slot = e[py::int_(0)].cast<int>();
                  rows[i].prefix_len = e[py::int_(1)].cast<int>();
                } catch (const py::cast_error&) {
                  throw bad();
                }
              }
            }
            // Validate before allocating the [W, V] result.
            const int wanted = md.check_decode(*a.arena, rows.data(), int(rows.size()));
            const py::ssize_t V = md.config().vocab_size;
            py::array_t<float> out;
            if (out_buffer.is_none()) {
              out = py::array_t<float>({py::ssize_t(wanted), V});
            } else {
              // The caller's buffer, reused step after step: a fresh [32, 262144] result is 33.5 MB, past glibc's
              // largest mmap threshold, so every such step would map, zero-fault and unmap it anew.
              if (!py::isinstance<py::array_t<float>>(out_buffer))
                throw py::type_error("out must be a float32 numpy array");
              auto buf = out_buffer.cast<py::array_t<float>>();
              if (buf.ndim() != 2 || buf.shape(1) != V || buf.shape(0) < wanted || !buf.writeable() ||
                  !(buf.flags() & py::array::c_style))
                throw py::value_error("out must be a writable C-contiguous float32 array of shape [>= " +
                                      std::to_string(wanted) + ", " + std::to_string(V) + "]");
              out = buf[py::slice(0, wanted, 1)].cast<py::array_t<float>>();
            }
            float* o = out.mutable_data();
            {
              py::gil_scoped_release nogil;
              md.decode(*a.arena, rows.data(), int(rows.size()), o);
            }
            return out;
          },
          py::arg("arena"), py::arg("slots"), py::arg("tokens"), py::arg("positions"), py::arg("logits") = py::none(),
          py::arg("out") = py::none(), py::arg("prefixes") = py::none(),
          "One decode step: token i at positions[i] of slots[i]. Consecutive entries with the same slot are one "
          "sequence's run at consecutive positions (causal within the run, at most `chunk` tokens); a slot may appear "
          "in one run only. logits: a flag per token (None: all), false where nobody reads that token's logits (it "
          "skips the LM head and the KV-shared layers). Returns float32 logits [W, V] of the W flagged tokens, in "
          "entry order; every number equals a plain one-token-per-slot decode of the same slots. out: a float32 "
          "C-contiguous [>= W, V] array to write them into, reused from step to step (its first W rows are returned). "
          "prefixes: per token None or (prefix_slot, prefix_len): the token reads positions [0, prefix_len) from "
          "that slot instead of its own (a shared prompt kept once; on the vnni and amx backends the rows naming one "
          "prefix attend it together). The prefix slot must hold those positions and is only read: it may not be "
          "one of the step's slots.")
      .def_property_readonly("profiling", &sg::Model::profiling)
      .def(
          "profile",
          [](const sg::Model& md) {
            py::dict d;
            const auto s = md.profile_seconds();
            const auto c = md.profile_calls();
            for (int i = 0; i < sg::kNumPhases; ++i) d[sg::phase_name(i)] = py::make_tuple(s[i], c[i]);
            return d;
          },
          "Per-phase (seconds, calls) since construction or reset_profile(); all zero unless FGM_PROFILE=1.")
      .def("reset_profile", &sg::Model::reset_profile)
      .def(
          "embedding_rows",
          [](const sg::Model& md, const std::vector<int>& tokens) {
            const sg::GatherTable& t = md.embedding();
            for (int r : tokens)
              if (r < 0 || r >= t.rows) throw std::invalid_argument("embedding_rows: token " + std::to_string(r) +
                                                                    " outside [0, " + std::to_string(t.rows) + ")");
            py::array_t<float> out({py::ssize_t(tokens.size()), py::ssize_t(t.cols)});
            for (size_t i = 0; i < tokens.size(); ++i) t.row(tokens[i], 1.0f, out.mutable_data() + i * t.cols);
            return out;
          },
          py::arg("tokens"),
          "Rows of the token-embedding table through the forward pass's own gather, unscaled (times 1): float32 "
          "[len(tokens), hidden_size].");

  py::class_<PyKvArena>(m, "KvArena",
                        "n_slots KV slots of model.kv_slot_bytes each, in a caller-owned writable buffer.")
      .def(py::init([](std::shared_ptr<sg::Model> md, py::object buffer, int64_t n_slots) {
             return std::make_unique<PyKvArena>(std::move(md), buffer, int_arg(n_slots, "n_slots"));
           }),
           py::arg("model"), py::arg("buffer"), py::arg("n_slots"))
      .def_property_readonly("model", [](const PyKvArena& a) { return a.model; },
                             "The Model whose slot layout the arena uses.")
      .def_property_readonly("n_slots", [](const PyKvArena& a) { return a.arena->n_slots(); })
      .def_property_readonly("slot_bytes", [](const PyKvArena& a) { return a.arena->layout().slot_bytes(); })
      .def("header", [](const PyKvArena& a, int64_t slot) { return header_dict(*a.arena, int_arg(slot, "slot")); },
           py::arg("slot"), "The slot header as a dict (valid, n_tokens, request_id, generation, sealed, ...).")
      .def(
          "n_tokens",
          [](const PyKvArena& a, int64_t slot) {
            const int s = int_arg(slot, "slot");
            a.arena->check_slot(s);
            return a.arena->n_tokens(s);
          },
          py::arg("slot"))
      .def(
          "checksum",
          [](const PyKvArena& a, int64_t slot) {
            const int s = int_arg(slot, "slot");
            py::gil_scoped_release nogil;
            return a.arena->kv_checksum(s);
          },
          py::arg("slot"))
      .def(
          "seal",
          [](PyKvArena& a, int64_t slot, uint64_t request_id, uint64_t generation) {
            const int s = int_arg(slot, "slot");
            py::gil_scoped_release nogil;
            a.arena->seal(s, request_id, generation);
          },
          py::arg("slot"), py::arg("request_id"), py::arg("generation"),
          "Stamp request id and generation and the checksum of the K/V as written (the prefill->decode handoff).")
      .def(
          "verify",
          [](const PyKvArena& a, int64_t slot, py::object request_id, py::object generation) {
            const int s = int_arg(slot, "slot");
            const bool ids = !request_id.is_none() || !generation.is_none();
            if (ids && (request_id.is_none() || generation.is_none()))
              throw py::value_error("verify: give both request_id and generation, or neither");
            const uint64_t rid = ids ? request_id.cast<uint64_t>() : 0, gen = ids ? generation.cast<uint64_t>() : 0;
            py::gil_scoped_release nogil;
            a.arena->verify(s, rid, gen, ids);
          },
          py::arg("slot"), py::arg("request_id") = py::none(), py::arg("generation") = py::none(),
          "Raise ValueError unless the slot is sealed for this model/layout (and these ids) with a matching checksum.")
      .def(
          "truncate",
          [](PyKvArena& a, int64_t slot, int64_t n_tokens) {
            const int s = int_arg(slot, "slot"), n = int_arg(n_tokens, "n_tokens");
            a.arena->check_slot(s);
            if (n < 0 || uint32_t(n) > a.arena->n_tokens(s))
              throw py::value_error("truncate: n_tokens " + std::to_string(n) + " is not in [0, " +
                                    std::to_string(a.arena->n_tokens(s)) + "] (the positions the slot holds)");
            a.arena->mark_written(s, uint32_t(n));
          },
          py::arg("slot"), py::arg("n_tokens"),
          "Claim only positions [0, n_tokens) (unsealed): after a decode step whose later tokens were drafts the "
          "caller rejected, the slot says what it really holds; the next decode rewrites from there.")
      .def("reset", [](PyKvArena& a, int64_t slot) { a.arena->reset(int_arg(slot, "slot")); }, py::arg("slot"),
           "Forget the slot's contents (zero its header).")
      .def(
          "stamp_lease",
          [](PyKvArena& a, int64_t slot, uint64_t generation, const py::bytes& digest) {
            const std::string d = digest;
            if (d.size() != sg::kLeaseDigestBytes)
              throw py::value_error("stamp_lease: the lease digest must be " + std::to_string(sg::kLeaseDigestBytes) +
                                    " bytes, got " + std::to_string(d.size()));
            uint8_t raw[sg::kLeaseDigestBytes];
            std::memcpy(raw, d.data(), sg::kLeaseDigestBytes);
            a.arena->stamp_lease(int_arg(slot, "slot"), generation, raw);
          },
          py::arg("slot"), py::arg("generation"), py::arg("lease_digest"),
          "The slot owner's record of which lease may write the slot: its generation and the digest of its secret "
          "(0 and zeros: none). Survives the writes; seal() stamps the same generation.")
      .def(
          "copy_slot",
          [](PyKvArena& a, int64_t slot, const PyKvArena& src, int64_t src_slot) {
            const int d = int_arg(slot, "slot"), s = int_arg(src_slot, "src_slot");
            py::gil_scoped_release nogil;
            a.arena->copy_slot(d, *src.arena, s);
          },
          py::arg("slot"), py::arg("src"), py::arg("src_slot"),
          "Copy slot src_slot of arena src (same layout) into slot, header included (unsealed): the copy holds the "
          "same positions and can be extended with prefill(pos0=n_tokens) or decode (prefix reuse).")
      .def(
          "export_positions",
          [](const PyKvArena& a, int64_t slot, int64_t begin, int64_t end) {
            const int s = int_arg(slot, "slot"), b = int_arg(begin, "begin"), e = int_arg(end, "end");
            a.arena->check_export(s, b, e);  // before allocating: a bad range must not become a huge buffer
            // Filled in place (no copy): the new bytes object is not visible to any other thread yet.
            auto out = py::reinterpret_steal<py::bytes>(
                PyBytes_FromStringAndSize(nullptr, py::ssize_t(uint64_t(e - b) * a.arena->layout().position_bytes())));
            if (!out) throw py::error_already_set();
            uint8_t* dst = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out.ptr()));
            {
              py::gil_scoped_release nogil;
              a.arena->export_positions(s, b, e, dst);
            }
            return out;
          },
          py::arg("slot"), py::arg("begin"), py::arg("end"),
          "The K/V of positions [begin, end) of the slot, every KV layer, as bytes ((end - begin) * "
          "kv_layout['position_bytes']; packed per layer, ring-free): what import_positions writes back.")
      .def(
          "import_positions",
          [](PyKvArena& a, int64_t slot, int64_t pos0, py::sequence parts) {
            const int s = int_arg(slot, "slot"), p0 = int_arg(pos0, "pos0");
            const uint64_t pb = a.arena->layout().position_bytes();
            std::vector<py::buffer_info> held;  // keeps every part's buffer alive and fixed while the GIL is off
            std::vector<sg::PackedPositions> packed;
            for (py::handle h : parts) {
              py::buffer_info info = py::reinterpret_borrow<py::buffer>(h).request();
              if (info.ndim > 1 || (info.ndim == 1 && info.strides[0] != info.itemsize))
                throw py::value_error("import_positions: part " + std::to_string(packed.size()) +
                                      " is not a contiguous 1-D buffer");
              const uint64_t bytes = uint64_t(info.size) * uint64_t(info.itemsize);
              if (bytes == 0 || bytes % pb != 0 || bytes / pb > uint64_t(INT32_MAX))
                throw py::value_error("import_positions: part " + std::to_string(packed.size()) + " holds " +
                                      std::to_string(bytes) + " bytes, not a positive multiple of the " +
                                      std::to_string(pb) + " bytes of one position in this layout");
              packed.push_back({static_cast<const uint8_t*>(info.ptr), int(bytes / pb)});
              held.push_back(std::move(info));
            }
            py::gil_scoped_release nogil;
            a.arena->import_positions(s, p0, packed);
          },
          py::arg("slot"), py::arg("pos0"), py::arg("parts"),
          "Write exported positions (a sequence of buffers from export_positions, consecutive) into the slot from "
          "pos0 on and set its token count to their end (unsealed); sliding layers take only what their rings hold.");

  py::class_<sg::RowSampler>(
      m, "RowSampler",
      "One sequence's sampler: its parameters, the history its penalties and min_tokens depend on, and its random "
      "state (docs/sampling.md). sample_rows() draws with it; observe() records each token the sequence took.")
      .def(py::init([](int vocab_size, float temperature, int top_k, float top_p, int n_logprobs, bool want_logprob,
                       float min_p, float presence_penalty, float frequency_penalty, float repetition_penalty,
                       int min_tokens, py::dict logit_bias, py::object stop_ids, py::object prompt_ids,
                       py::object rng_state) {
             sg::RowSamplerParams p;
             p.sample = sg::SampleParams{temperature, top_k, top_p, n_logprobs};
             p.want_logprob = want_logprob;
             p.min_p = min_p;
             p.presence = presence_penalty;
             p.frequency = frequency_penalty;
             p.repetition = repetition_penalty;
             p.min_tokens = min_tokens;
             for (auto item : logit_bias) {
               const int64_t id = item.first.cast<int64_t>();
               if (id < 0 || id >= vocab_size)
                 throw py::value_error("logit_bias: token " + std::to_string(id) + " is outside the vocabulary");
               p.bias.emplace_back(int(id), item.second.cast<float>());
             }
             std::sort(p.bias.begin(), p.bias.end());  // a fixed order: the sums do not depend on the dict's
             const std::vector<int32_t> stops = int_vector(stop_ids, "stop_ids");
             p.stop_ids.assign(stops.begin(), stops.end());
             const std::vector<int32_t> prompt = int_vector(prompt_ids, "prompt_ids");
             const uint64_t state = rng_arg(rng_state);
             return std::make_unique<sg::RowSampler>(p, vocab_size, prompt.data(), int(prompt.size()), state);
           }),
           py::arg("vocab_size"), py::kw_only(), py::arg("temperature") = 1.0f, py::arg("top_k") = 0,
           py::arg("top_p") = 1.0f, py::arg("n_logprobs") = 0, py::arg("want_logprob") = true,
           py::arg("min_p") = 0.0f, py::arg("presence_penalty") = 0.0f, py::arg("frequency_penalty") = 0.0f,
           py::arg("repetition_penalty") = 1.0f, py::arg("min_tokens") = 0, py::arg("logit_bias") = py::dict(),
           py::arg("stop_ids") = py::list(), py::arg("prompt_ids") = py::list(), py::arg("rng_state") = 0,
           "want_logprob False with temperature 0 and n_logprobs 0: the token is the argmax and its logprob is not "
           "computed (reported 0). stop_ids: held off while fewer than min_tokens tokens were observed. prompt_ids: "
           "what repetition_penalty counts besides the output.")
      .def("observe", [](sg::RowSampler& r, int64_t token) { r.observe(int_arg(token, "token")); }, py::arg("token"),
           "The sequence took `token` (counted by the penalties and min_tokens).")
      .def_property_readonly("rng_state", &sg::RowSampler::rng_state)
      .def_property_readonly("generated", &sg::RowSampler::generated)
      .def_property_readonly("vocab_size", &sg::RowSampler::vocab_size)
      .def_property_readonly("n_logprobs", &sg::RowSampler::n_logprobs);

  m.def(
      "sample_rows",
      [](py::array_t<float, py::array::c_style> logits, py::sequence samplers, py::object masks, py::object model,
         py::object which) {
        if (logits.ndim() != 2) throw py::value_error("sample_rows: logits must be a 2-D [rows, vocab] float32 array");
        if (!logits.writeable())
          throw py::value_error("sample_rows: logits must be writable (rows are processed in place)");
        const py::ssize_t R = logits.shape(0), V = logits.shape(1);
        // The rows sampled: all of them in order, or the ones `which` names (a decode step's verification samples
        // some rows of its logits: picking them here spares a copy of 1 MB a row).
        std::vector<py::ssize_t> pick;
        if (which.is_none()) {
          for (py::ssize_t r = 0; r < R; ++r) pick.push_back(r);
        } else {
          std::vector<bool> seen(size_t(R), false);
          for (py::handle h : py::iterable(which)) {
            const py::ssize_t r = h.cast<py::ssize_t>();
            if (r < 0 || r >= R)
              throw py::value_error("sample_rows: row " + std::to_string(r) + " is outside logits' " +
                                    std::to_string(R) + " rows");
            if (seen[size_t(r)])
              throw py::value_error("sample_rows: row " + std::to_string(r) + " named twice (rows are processed in "
                                    "place)");
            seen[size_t(r)] = true;
            pick.push_back(r);
          }
        }
        const py::ssize_t B = py::ssize_t(pick.size());
        if (py::ssize_t(py::len(samplers)) != B)
          throw py::value_error("sample_rows: " + std::to_string(py::len(samplers)) + " samplers for " +
                                std::to_string(B) + " rows");
        std::vector<py::buffer_info> held;  // the masks' buffers, kept fixed while the GIL is off
        std::vector<sg::SampleRow> rows(B);
        py::list mask_list = masks.is_none() ? py::list() : py::list(masks);
        if (!masks.is_none() && py::ssize_t(py::len(mask_list)) != B)
          throw py::value_error("sample_rows: masks must be None or one entry (None or a bitmask) per row");
        float* base = logits.mutable_data();
        for (py::ssize_t b = 0; b < B; ++b) {
          auto* r = samplers[b].cast<sg::RowSampler*>();
          if (r->vocab_size() != V)
            throw py::value_error("sample_rows: sampler " + std::to_string(b) + " is for a vocabulary of " +
                                  std::to_string(r->vocab_size()) + ", the rows have " + std::to_string(V));
          rows[b].sampler = r;
          rows[b].logits = base + pick[size_t(b)] * V;
          if (!masks.is_none() && !mask_list[b].is_none()) {
            py::buffer_info info = py::reinterpret_borrow<py::buffer>(mask_list[b]).request();
            const py::ssize_t bytes = info.size * info.itemsize;
            if (info.ndim != 1 || info.strides[0] != info.itemsize || bytes % 4 != 0)
              throw py::value_error("sample_rows: mask " + std::to_string(b) +
                                    " must be a contiguous 1-D buffer of 32-bit words");
            rows[b].mask = static_cast<const uint32_t*>(info.ptr);
            rows[b].mask_words = int(bytes / 4);
            held.push_back(std::move(info));
          }
        }
        std::vector<sg::RowOutcome> out(B);
        sg::Model* on = model.is_none() ? nullptr : model.cast<sg::Model*>();
        {
          py::gil_scoped_release nogil;
          if (on) on->sample_rows(rows.data(), int(B), out.data());
          else sg::sample_rows(rows.data(), int(B), out.data());
        }
        py::list res;
        for (py::ssize_t b = 0; b < B; ++b) {
          if (!out[b].error.empty()) res.append(py::str(out[b].error));
          else res.append(py::make_tuple(out[b].result.token, rows[b].sampler->rng_state(), out[b].result.logprob,
                                         out[b].result.top));
        }
        return res;
      },
      py::arg("logits"), py::arg("samplers"), py::arg("masks") = py::none(), py::arg("model") = py::none(),
      py::arg("rows") = py::none(),
      "The next token of each row of logits [B, V] (float32, rewritten in place by the bias and penalties) with "
      "samplers[b]; or, with rows (distinct indices into logits), of row rows[b] with samplers[b]. masks[b]: None or "
      "the row's llguidance bitmask (bit i of 32-bit word i/32 allows id i). One "
      "entry per row: (token, rng_state, logprob, [(id, logprob), ...]), or the error message (str) of a row that "
      "failed (its random state unchanged). Does not observe() the tokens drawn. model: a Model whose thread pool "
      "shares the rows out (same tokens as without; one call at a time with its forward passes).");

  m.def(
      "prompt_logprobs",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, py::object tokens, int top_n) {
        if (logits.ndim() != 2) throw py::value_error("prompt_logprobs: logits must be a 2-D [rows, vocab] array");
        const std::vector<int32_t> t = int_vector(tokens, "tokens");
        const py::ssize_t R = logits.shape(0), V = logits.shape(1);
        if (py::ssize_t(t.size()) != R)
          throw py::value_error("prompt_logprobs: " + std::to_string(t.size()) + " tokens for " + std::to_string(R) +
                                " rows");
        if (top_n < 0 || top_n > V) throw py::value_error("prompt_logprobs: top_n must lie in [0, vocab]");
        py::array_t<float> lp(R), top_lp({R, py::ssize_t(top_n)});
        py::array_t<int32_t> rank(R), top_ids({R, py::ssize_t(top_n)});
        float *plp = lp.mutable_data(), *ptl = top_lp.mutable_data();
        int32_t *prk = rank.mutable_data(), *pti = top_ids.mutable_data();
        const float* x = logits.data();
        {
          py::gil_scoped_release nogil;
          for (py::ssize_t r = 0; r < R; ++r) {
            int rk = 0;
            const sg::SampleResult s = sg::token_logprob(x + r * V, int(V), t[r], top_n, &rk);
            plp[r] = s.logprob;
            prk[r] = rk;
            for (int i = 0; i < top_n; ++i) pti[r * top_n + i] = s.top[i].first, ptl[r * top_n + i] = s.top[i].second;
          }
        }
        return py::make_tuple(lp, rank, top_ids, top_lp);
      },
      py::arg("logits"), py::arg("tokens"), py::arg("top_n") = 0,
      "Row r's log-softmax at tokens[r] (the token that followed), its rank (1 = most likely) and the top_n "
      "(id, logprob), best first: (logprob [R], rank [R], top_ids [R, top_n], top_logprobs [R, top_n]).");

  m.def(
      "attention_rows",
      [](py::array q, py::array k, py::array v, py::object ks, py::object vs, int kv_head, int p0, int window,
         const std::string& kernel, bool split) {
        // The attention kernels on caller-made data, for tests: the prefill tile kernels against attend().
        auto qf = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(q);
        if (!qf || qf.ndim() != 3) throw py::value_error("attention_rows: q must be a [rows, nq, head_dim] array");
        const int rows = int(qf.shape(0)), nq = int(qf.shape(1)), hd = int(qf.shape(2));
        if (k.ndim() != 3 || v.ndim() != 3 || k.shape(2) != hd || !k.dtype().is(v.dtype()) ||
            k.shape(0) != v.shape(0) || k.shape(1) != v.shape(1) || !(k.flags() & v.flags() & py::array::c_style))
          throw py::value_error("attention_rows: k and v must be C-contiguous [cap, kv_heads, head_dim] arrays of one "
                                "dtype");
        const char kind = k.dtype().kind();
        const int E = int(k.itemsize());
        if (!((kind == 'i' && E == 1) || (kind == 'f' && (E == 2 || E == 4))))
          throw py::value_error("attention_rows: k and v must be int8, float16 or float32");
        const int cap = int(k.shape(0)), nkv = int(k.shape(1));
        if (kv_head < 0 || kv_head >= nkv) throw py::value_error("attention_rows: kv_head out of range");
        if (rows < 1 || nq < 1 || hd % 16 || p0 < 0) throw py::value_error("attention_rows: bad rows, heads or p0");
        const int lo0 = window > 0 ? std::max(0, p0 - window + 1) : 0;
        if (p0 + rows - lo0 > cap) throw py::value_error("attention_rows: the attended positions exceed the ring");
        py::array_t<float, py::array::c_style | py::array::forcecast> ksa, vsa;
        if (E == 1) {
          if (ks.is_none() || vs.is_none()) throw py::value_error("attention_rows: int8 K/V need ks and vs");
          ksa = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(ks);
          vsa = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(vs);
          if (!ksa || !vsa || ksa.size() != cap || vsa.size() != cap)
            throw py::value_error("attention_rows: ks and vs must hold one scale per cache row");
        }
        const bool amx = kernel == "tiles_amx", tiles = kernel == "tiles" || amx, tiles_ymm = kernel == "tiles_ymm";
        if (!tiles && !tiles_ymm && kernel != "ymm" && kernel != "zmm")
          throw py::value_error("attention_rows: kernel must be 'tiles', 'tiles_amx', 'tiles_ymm', 'zmm' or 'ymm'");
        if (amx && !sg::amx_tiles_usable())
          throw py::value_error("attention_rows: 'tiles_amx' needs AMX tiles (an AMX CPU whose tile state holds)");
        const int max_vectors = amx ? sg::ops::kAttendRowsVectorsAmx : sg::ops::kAttendRowsVectors;
        if (tiles && (!sg::cpu_supports(sg::Backend::Vnni) || hd % 32 || rows * nq > max_vectors))
          throw py::value_error("attention_rows: the tile kernel needs AVX-512 VNNI, head_dim % 32 == 0 and "
                                "rows * nq <= " + std::to_string(max_vectors));
        if (tiles_ymm && (hd % 32 || rows * nq > sg::ops::kAttendRowsVectors))
          throw py::value_error("attention_rows: the ymm tile kernel needs head_dim % 32 == 0 and rows * nq <= " +
                                std::to_string(sg::ops::kAttendRowsVectors));
        if (kernel == "zmm" && !sg::cpu_supports(sg::Backend::Vnni))
          throw py::value_error("attention_rows: the zmm kernel needs AVX-512");
        if (split && kernel != "zmm" && kernel != "ymm")
          throw py::value_error("attention_rows: split is for the zmm and ymm kernels");
        const int row_bytes = nkv * hd * E;
        const sg::ops::AttnCache c{static_cast<const uint8_t*>(k.data()), static_cast<const uint8_t*>(v.data()),
                                   E == 1 ? ksa.data() : nullptr, E == 1 ? vsa.data() : nullptr, row_bytes,
                                   kv_head * hd * E, cap, E == 4};
        py::array_t<float> out({rows, nq, hd});
        float* o = out.mutable_data();
        const float* qp = qf.data();
        {
          py::gil_scoped_release nogil;
          if (tiles) {
            std::vector<float> scratch(sg::ops::attend_rows_scratch_floats(rows * nq, hd));
            sg::ops::attend_rows_avx512(qp, nq * hd, rows, nq, hd, c, p0, window, o, nq * hd, scratch.data(), amx);
          } else if (tiles_ymm) {
            std::vector<float> scratch(sg::ops::attend_rows_scratch_floats(rows * nq, hd));
            sg::ops::attend_rows_avx2(qp, nq * hd, rows, nq, hd, c, p0, window, o, nq * hd, scratch.data());
          } else if (split) {
            // As single-stream decode runs it: each part of the positions on its own, merged after.
            const bool zmm = kernel == "zmm";
            std::vector<float> scratch(sg::ops::attend_avx512_scratch_floats(nq, hd));
            for (int r = 0; r < rows; ++r) {
              const int pos = p0 + r, lo = window > 0 ? std::max(0, pos - window + 1) : 0, span = pos - lo + 1;
              const int np = sg::ops::attend_parts(span);
              std::vector<float> parts(size_t(np) * nq * (hd + 2));
              float* stats = parts.data() + size_t(np) * nq * hd;
              for (int p = 0; p < np; ++p)
                (zmm ? sg::ops::attend_avx512_part : sg::ops::attend_part)(
                    qp + size_t(r) * nq * hd, hd, nq, hd, c, sg::ops::attend_part_start(lo, span, p),
                    sg::ops::attend_part_start(lo, span, p + 1) - 1, parts.data() + size_t(p) * nq * hd, hd,
                    scratch.data(), stats + size_t(p) * nq * 2);
              (zmm ? sg::ops::attend_merge_parts_avx512 : sg::ops::attend_merge_parts_ymm)(
                  parts.data(), stats, np, nq, hd, o + size_t(r) * nq * hd, hd);
            }
          } else {
            std::vector<float> scratch(std::max(size_t(nq) * (p0 + rows), sg::ops::attend_avx512_scratch_floats(nq, hd)));
            for (int r = 0; r < rows; ++r) {
              const int pos = p0 + r, lo = window > 0 ? std::max(0, pos - window + 1) : 0;
              (kernel == "ymm" ? sg::ops::attend : sg::ops::attend_avx512)(
                  qp + size_t(r) * nq * hd, hd, nq, hd, c, lo, pos, o + size_t(r) * nq * hd, hd, scratch.data());
            }
          }
        }
        return out;
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("ks") = py::none(), py::arg("vs") = py::none(),
      py::arg("kv_head") = 0, py::arg("p0") = 0, py::arg("window") = 0, py::arg("kernel") = "tiles",
      py::arg("split") = false,
      "Attention of rows consecutive query rows at positions p0.. (q [rows, nq, head_dim]) against a ring cache "
      "k, v [cap, kv_heads, head_dim] (int8 codes with per-row scales ks, vs; or float16/float32), position p in row "
      "p % cap, row r attending [max(0, p0 + r - window + 1) (window > 0), p0 + r]: kernel 'tiles' is the prefill "
      "tile kernel ('tiles_amx': its int8 dot products on AMX tiles, the same bits; f16 ones on AMX-BF16 tiles where "
      "kernels.amx_bf16_tiles_usable(), within the f32 tolerance; 'tiles_ymm': the tile kernel on AVX2), 'zmm' / "
      "'ymm' attend() per row; 'zmm' or 'ymm' with split=True attends each part of a row's positions on its own and "
      "merges them, as single-stream decode does (the bits of split=False). For tests (docs/engine-api.md).");

  m.def(
      "sample",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, float temperature, int top_k,
         float top_p, py::object rng_state, int n_logprobs) {
        if (logits.ndim() != 1) throw py::value_error("sample: logits must be a 1-D row");
        if (logits.size() > INT32_MAX) throw py::value_error("sample: logits row too long");
        uint64_t state = rng_arg(rng_state);
        sg::SampleParams p{temperature, top_k, top_p, n_logprobs};
        sg::SampleResult r;
        {
          py::gil_scoped_release nogil;
          r = sg::sample(logits.data(), int(logits.size()), p, &state);
        }
        return py::make_tuple(r.token, state, r.logprob, r.top);
      },
      py::arg("logits"), py::arg("temperature") = 1.0f, py::arg("top_k") = 0, py::arg("top_p") = 1.0f,
      py::arg("rng_state") = 0, py::arg("n_logprobs") = 0,
      "Sample one token. Returns (token, new_rng_state, logprob, [(id, logprob), ...]). temperature 0 = greedy. "
      "See docs/engine-api.md for the generator and which distribution the logprobs describe.");

  m.def(
      "elementwise",
      [](const std::string& op, const std::string& isa, const F32Vec& x, std::optional<F32Vec> a,
         std::optional<F32Vec> w, double p0, double p1, double p2, int block) -> py::object {
        // One element-wise kernel of the Model's table (ops.h) on one row, for the tests of the zmm twins.
        if (isa != "avx2" && isa != "avx512") throw py::value_error("elementwise: isa must be 'avx2' or 'avx512'");
        if (!sg::ops::cpu_has_avx2_fma_f16c()) throw std::runtime_error("elementwise: needs AVX2, FMA and F16C");
        if (isa == "avx512" && !sg::cpu_supports(sg::Backend::Vnni))
          throw std::runtime_error("elementwise: this CPU has no AVX-512 (the vnni backend)");
        const sg::ops::Elementwise& e = isa == "avx2" ? sg::ops::elementwise_avx2() : sg::ops::elementwise_avx512();
        if (x.ndim() != 1) throw py::value_error("elementwise: x must be 1-D");
        const int n = int(x.size());
        auto need = [&](const std::optional<F32Vec>& v, const char* name, int len) -> const float* {
          if (!v) throw py::value_error(std::string("elementwise: ") + op + " needs " + name);
          if (v->ndim() != 1 || v->size() != len)
            throw py::value_error(std::string("elementwise: ") + name + " must have " + std::to_string(len) + " floats");
          return v->data();
        };
        auto opt = [&](const std::optional<F32Vec>& v, const char* name) { return v ? need(v, name, n) : nullptr; };
        py::array_t<float> y(py::ssize_t{n});
        float* yp = y.mutable_data();
        std::memcpy(yp, x.data(), sizeof(float) * n);
        const float f0 = float(p0), f1 = float(p1), f2 = float(p2);
        if (op == "rmsnorm") e.rmsnorm(x.data(), opt(w, "w"), yp, n, f0);
        else if (op == "add_rmsnorm") e.add_rmsnorm(yp, need(a, "a", n), need(w, "w", n), n, f0);
        else if (op == "scale") e.scale(yp, n, f0);
        else if (op == "gelu_mul") e.gelu_mul(yp, need(a, "a", n), n);
        else if (op == "softcap") e.softcap(yp, n, f0);
        else if (op == "fwht_blocks") {
          if (block < 1 || (block & (block - 1)) || n % block) throw py::value_error("elementwise: bad block");
          e.fwht_blocks(yp, n, block);
        } else if (op == "head_norm_rope") {
          if (n % 2 || block < 1 || (block & (block - 1)) || n % block) throw py::value_error("elementwise: bad head");
          e.head_norm_rope(yp, need(w, "w", n), n, need(a, "a (cos | sin)", n), block, f0);
        } else if (op == "ple_mix") e.ple_mix(yp, need(a, "a", n), need(w, "w", n), n, f0, f1, f2);
        else if (op == "quantize_row_i8") {
          py::array_t<int8_t> q(py::ssize_t{n});
          float scale = 0;
          e.quantize_row_i8(x.data(), n, q.mutable_data(), &scale);
          return py::make_tuple(q, scale);
        } else if (op == "store_row_f16") {
          py::array_t<uint16_t> h(py::ssize_t{n});
          e.store_row_f16(x.data(), n, h.mutable_data());
          return std::move(h);
        } else {
          throw py::value_error("elementwise: unknown op '" + op + "'");
        }
        return std::move(y);
      },
      py::arg("op"), py::arg("isa"), py::arg("x"), py::arg("a") = py::none(), py::arg("w") = py::none(),
      py::arg("p0") = 0.0, py::arg("p1") = 0.0, py::arg("p2") = 0.0, py::arg("block") = 1,
      "Runs one element-wise kernel (ops.h Elementwise: rmsnorm, add_rmsnorm, scale, gelu_mul, softcap, "
      "fwht_blocks, head_norm_rope, ple_mix, quantize_row_i8, store_row_f16) of the ymm ('avx2') or zmm ('avx512') "
      "table on a copy of the 1-D row x; p0..p2 are its scalar arguments (eps, scale, cap) in the C++ order and "
      "block its block size. Returns the new row ((codes, scale) for quantize_row_i8, f16 bits for store_row_f16).");
}
