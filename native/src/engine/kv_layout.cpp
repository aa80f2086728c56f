#include "kv_layout.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace sg {

namespace {

uint64_t align64(uint64_t x) { return (x + 63) & ~uint64_t(63); }

// A streaming 64-bit checksum: four independent multiply-rotate lanes over 8-byte words (fast enough to cover
// tens of MB of K/V at memory speed), a splitmix-style finaliser. It detects torn or mismatched slots; it is not
// a cryptographic hash.
class Checksum {
 public:
  void update(const uint8_t* p, size_t n) {
    total_ += n;
    if (fill_) {
      size_t take = std::min(n, sizeof(buf_) - fill_);
      std::memcpy(buf_ + fill_, p, take);
      fill_ += take, p += take, n -= take;
      if (fill_ < sizeof(buf_)) return;
      block(buf_);
      fill_ = 0;
    }
    for (; n >= sizeof(buf_); p += sizeof(buf_), n -= sizeof(buf_)) block(p);
    std::memcpy(buf_, p, n);
    fill_ = n;
  }
  uint64_t finish() {
    std::memset(buf_ + fill_, 0, sizeof(buf_) - fill_);
    if (fill_) block(buf_);
    uint64_t h = total_ * kMulA;
    for (uint64_t l : lane_) h = mix(h ^ mix(l));
    return h;
  }

 private:
  static constexpr uint64_t kMulA = 0x9E3779B97F4A7C15ull, kMulB = 0xC2B2AE3D27D4EB4Full;
  static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  void block(const uint8_t* p) {
    for (int i = 0; i < 4; ++i) {
      uint64_t w;
      std::memcpy(&w, p + 8 * i, 8);
      lane_[i] = rotl(lane_[i] + w * kMulB, 31) * kMulA;
    }
  }
  uint64_t lane_[4] = {1, 2, 3, 4};
  uint8_t buf_[32];
  size_t fill_ = 0;
  uint64_t total_ = 0;
};

}  // namespace

const char* kv_dtype_name(KvDtype d) {
  return d == KvDtype::F32 ? "f32" : d == KvDtype::F16 ? "f16" : d == KvDtype::Int8 ? "int8" : "unknown";
}

KvDtype kv_dtype_from_name(const std::string& name) {
  if (name == "int8") return KvDtype::Int8;
  if (name == "f16") return KvDtype::F16;
  if (name == "f32") return KvDtype::F32;
  throw std::invalid_argument("KV cache dtype must be 'int8', 'f16' or 'f32', got '" + name + "'");
}

KvLayout::KvLayout(const FgmFile& file, int max_context, int chunk, KvDtype dtype) {
  const ModelConfig& c = file.config();
  if (max_context < 1) throw std::invalid_argument("max_context must be at least 1, got " + std::to_string(max_context));
  if (chunk < 1) throw std::invalid_argument("chunk must be at least 1, got " + std::to_string(chunk));
  model_sig_ = file.layout_signature();
  max_context_ = max_context;
  chunk_ = chunk;
  dtype_ = dtype;
  window_ = c.sliding_window;
  layers_.assign(c.num_layers, KvLayerLayout{});
  sliding_.assign(c.num_layers, false);
  uint64_t off = sizeof(SlotHeader);
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerSpec& ls = c.layers[i];
    sliding_[i] = ls.sliding;
    if (!ls.owns_kv) continue;
    KvLayerLayout& L = layers_[i];
    L.layer = i;
    L.cap = ls.sliding ? int(std::min<int64_t>(max_context, int64_t(c.sliding_window) + chunk)) : max_context;
    L.row_bytes = c.num_kv_heads * ls.head_dim * kv_element_bytes(dtype);
    const uint64_t codes = uint64_t(L.cap) * L.row_bytes, scales = uint64_t(L.cap) * sizeof(float);
    off = align64(off), L.k_off = off, off += codes;
    off = align64(off), L.v_off = off, off += codes;
    if (dtype == KvDtype::Int8) {
      off = align64(off), L.ks_off = off, off += scales;
      off = align64(off), L.vs_off = off, off += scales;
    }
    position_bytes_ += 2 * uint64_t(L.row_bytes) + (dtype == KvDtype::Int8 ? 2 * sizeof(float) : 0);
  }
  slot_bytes_ = align64(off);
}

std::string KvLayout::resume_error(uint32_t n_tokens, int pos) const {
  if (pos < 0) return "position " + std::to_string(pos) + " is negative";
  if (uint32_t(pos) > n_tokens)
    return "position " + std::to_string(pos) + " would leave a gap: the slot holds K/V for " + std::to_string(n_tokens) +
           " positions";
  // Rewinding: a ring row of a position the new token needs may already hold a later position.
  for (size_t i = 0; i < layers_.size(); ++i) {
    const KvLayerLayout& L = layers_[i];
    if (L.layer < 0 || !sliding_[i] || pos == 0) continue;
    const int64_t first_needed = std::max<int64_t>(0, int64_t(pos) - window_ + 1);
    if (first_needed < int64_t(n_tokens) - L.cap)
      return "cannot rewind to position " + std::to_string(pos) + ": the sliding-window ring of layer " +
             std::to_string(i) + " (" + std::to_string(L.cap) + " rows) no longer holds position " +
             std::to_string(first_needed) + " (slot holds " + std::to_string(n_tokens) + " positions)";
  }
  return {};
}

KvArena::KvArena(const KvLayout& layout, uint8_t* base, size_t bytes, int n_slots)
    : layout_(layout), base_(base), n_slots_(n_slots) {
  if (n_slots < 1) throw std::invalid_argument("n_slots must be at least 1, got " + std::to_string(n_slots));
  const uint64_t need = uint64_t(n_slots) * layout.slot_bytes();
  if (bytes < need)
    throw std::invalid_argument("KV arena buffer holds " + std::to_string(bytes) + " bytes, " + std::to_string(n_slots) +
                                " slots need " + std::to_string(need) + " (" + std::to_string(layout.slot_bytes()) +
                                " per slot)");
  if (reinterpret_cast<uintptr_t>(base) % 8 != 0)
    throw std::invalid_argument("KV arena buffer must be 8-byte aligned");
}

void KvArena::check_slot(int s) const {
  if (s < 0 || s >= n_slots_)
    throw std::out_of_range("slot " + std::to_string(s) + " out of range [0, " + std::to_string(n_slots_) + ")");
}

bool KvArena::header_matches(int s) const {
  const SlotHeader* h = header(s);
  return std::memcmp(h->magic, kSlotMagic, 8) == 0 && h->model_signature == layout_.model_signature() &&
         h->max_context == uint32_t(layout_.max_context()) && h->chunk == uint32_t(layout_.chunk()) &&
         h->slot_bytes == layout_.slot_bytes() && h->n_tokens <= uint32_t(layout_.max_context()) &&
         ((h->flags >> 8) & 0xFF) == uint32_t(layout_.dtype());
}

void KvArena::check_write(int s, int pos, int count) const {
  check_slot(s);
  if (count < 1) throw std::invalid_argument("nothing to write: token count " + std::to_string(count));
  if (pos < 0 || int64_t(pos) + count > layout_.max_context())
    throw std::invalid_argument("positions [" + std::to_string(pos) + ", " + std::to_string(int64_t(pos) + count) +
                                ") exceed max_context " + std::to_string(layout_.max_context()));
  const std::string err = layout_.resume_error(n_tokens(s), pos);
  if (!err.empty()) throw std::invalid_argument("slot " + std::to_string(s) + ": " + err);
}

void KvArena::mark_written(int s, uint32_t n_tokens) {
  SlotHeader* h = header(s);
  if (!header_matches(s)) {
    const uint64_t lease = h->generation;
    uint8_t digest[kLeaseDigestBytes];
    std::memcpy(digest, h->lease_digest, kLeaseDigestBytes);
    std::memset(h, 0, sizeof(SlotHeader));
    h->generation = lease;
    std::memcpy(h->lease_digest, digest, kLeaseDigestBytes);
    std::memcpy(h->magic, kSlotMagic, 8);
    h->model_signature = layout_.model_signature();
    h->max_context = uint32_t(layout_.max_context());
    h->chunk = uint32_t(layout_.chunk());
    h->slot_bytes = layout_.slot_bytes();
    h->flags = uint32_t(layout_.dtype()) << 8;
  }
  h->n_tokens = n_tokens;
  h->flags &= ~kSlotSealed;
  h->checksum = 0;
}

uint64_t KvArena::kv_checksum(int s) const {
  check_slot(s);
  const uint32_t n = n_tokens(s);
  const uint8_t* base = slot(s);
  Checksum ck;
  for (int i = 0; i < layout_.num_layers(); ++i) {
    const KvLayerLayout& L = layout_.layer(i);
    if (L.layer < 0) continue;
    const int64_t first = std::max<int64_t>(0, int64_t(n) - L.cap);
    for (int64_t p = first; p < n; ++p) {
      const uint64_t row = uint64_t(p % L.cap);
      ck.update(base + L.k_off + row * L.row_bytes, L.row_bytes);
      ck.update(base + L.v_off + row * L.row_bytes, L.row_bytes);
      if (layout_.dtype() == KvDtype::Int8) {
        ck.update(base + L.ks_off + row * sizeof(float), sizeof(float));
        ck.update(base + L.vs_off + row * sizeof(float), sizeof(float));
      }
    }
  }
  return ck.finish();
}

void KvArena::seal(int s, uint64_t request_id, uint64_t generation) {
  check_slot(s);
  if (!header_matches(s))
    throw std::invalid_argument("slot " + std::to_string(s) + " holds no K/V written with this model and layout");
  SlotHeader* h = header(s);
  h->request_id = request_id;
  h->generation = generation;
  h->checksum = kv_checksum(s);
  h->flags |= kSlotSealed;
}

void KvArena::verify(int s, uint64_t request_id, uint64_t generation, bool check_ids) const {
  check_slot(s);
  const SlotHeader* h = header(s);
  const std::string where = "slot " + std::to_string(s) + ": ";
  if (std::memcmp(h->magic, kSlotMagic, 8) != 0) throw std::invalid_argument(where + "no slot header (bad magic)");
  if (h->model_signature != layout_.model_signature())
    throw std::invalid_argument(where + "K/V was written by a different model file (layout signature mismatch)");
  if (!header_matches(s))
    throw std::invalid_argument(where + "K/V was written with a different slot geometry (max_context " +
                                std::to_string(h->max_context) + ", chunk " + std::to_string(h->chunk) + ", " +
                                kv_dtype_name(KvDtype((h->flags >> 8) & 0xFF)) + ", " + std::to_string(h->slot_bytes) +
                                " bytes; expected " + std::to_string(layout_.max_context()) + ", " +
                                std::to_string(layout_.chunk()) + ", " + kv_dtype_name(layout_.dtype()) + ", " +
                                std::to_string(layout_.slot_bytes()) + ")");
  if (check_ids && h->request_id != request_id)
    throw std::invalid_argument(where + "request id " + std::to_string(h->request_id) + " != expected " +
                                std::to_string(request_id));
  if (check_ids && h->generation != generation)
    throw std::invalid_argument(where + "generation " + std::to_string(h->generation) + " != expected " +
                                std::to_string(generation) + " (stale lease)");
  if (!(h->flags & kSlotSealed)) throw std::invalid_argument(where + "not sealed (K/V changed after the last seal)");
  if (kv_checksum(s) != h->checksum) throw std::invalid_argument(where + "K/V checksum mismatch (torn or overwritten)");
}

void KvArena::stamp_lease(int s, uint64_t generation, const uint8_t (&digest)[kLeaseDigestBytes]) {
  check_slot(s);
  header(s)->generation = generation;
  std::memcpy(header(s)->lease_digest, digest, kLeaseDigestBytes);
}

void KvArena::reset(int s) {
  check_slot(s);
  std::memset(header(s), 0, sizeof(SlotHeader));
}

void KvArena::copy_slot(int s, const KvArena& src, int src_slot) {
  check_slot(s);
  src.check_slot(src_slot);
  if (!src.layout_.same_as(layout_))
    throw std::invalid_argument("copy_slot: the source arena has a different model or slot geometry");
  SlotHeader* h = header(s);
  const uint64_t lease = h->generation;
  uint8_t digest[kLeaseDigestBytes];
  std::memcpy(digest, h->lease_digest, kLeaseDigestBytes);
  if (src.slot(src_slot) != slot(s)) std::memmove(slot(s), src.slot(src_slot), layout_.slot_bytes());
  h->generation = lease;
  std::memcpy(h->lease_digest, digest, kLeaseDigestBytes);
  h->flags &= ~kSlotSealed;
}

void KvArena::check_export(int s, int begin, int end) const {
  check_slot(s);
  const uint32_t n = n_tokens(s);
  if (begin < 0 || begin >= end || uint32_t(end) > n)
    throw std::invalid_argument("export_positions: positions [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") are not a non-empty range the slot holds (slot " + std::to_string(s) + " holds " +
                                std::to_string(n) + " positions)");
  for (int i = 0; i < layout_.num_layers(); ++i) {
    const KvLayerLayout& L = layout_.layer(i);
    if (L.layer >= 0 && int64_t(begin) < int64_t(n) - L.cap)
      throw std::invalid_argument("export_positions: the sliding-window ring of layer " + std::to_string(i) + " (" +
                                  std::to_string(L.cap) + " rows) no longer holds position " + std::to_string(begin) +
                                  " (slot " + std::to_string(s) + " holds " + std::to_string(n) + " positions)");
  }
}

void KvArena::export_positions(int s, int begin, int end, uint8_t* out) const {
  check_export(s, begin, end);
  const int m = end - begin;
  const bool scales = layout_.dtype() == KvDtype::Int8;
  const uint8_t* base = slot(s);
  for (int i = 0; i < layout_.num_layers(); ++i) {
    const KvLayerLayout& L = layout_.layer(i);
    if (L.layer < 0) continue;
    uint8_t* k = out;
    uint8_t* v = k + size_t(m) * L.row_bytes;
    uint8_t* sc = v + size_t(m) * L.row_bytes;  // K scales [m], then V scales [m]; unaligned, so memcpy only
    for (int j = 0; j < m; ++j) {
      const uint64_t row = uint64_t(begin + j) % L.cap;
      std::memcpy(k + size_t(j) * L.row_bytes, base + L.k_off + row * L.row_bytes, L.row_bytes);
      std::memcpy(v + size_t(j) * L.row_bytes, base + L.v_off + row * L.row_bytes, L.row_bytes);
      if (scales) {
        std::memcpy(sc + j * sizeof(float), base + L.ks_off + row * sizeof(float), sizeof(float));
        std::memcpy(sc + (m + j) * sizeof(float), base + L.vs_off + row * sizeof(float), sizeof(float));
      }
    }
    out = sc + (scales ? 2 * size_t(m) * sizeof(float) : 0);
  }
}

void KvArena::import_positions(int s, int pos0, const std::vector<PackedPositions>& parts) {
  int64_t total = 0;
  for (const PackedPositions& p : parts) {
    if (p.count < 1) throw std::invalid_argument("import_positions: a part holds no positions");
    total += p.count;
  }
  if (parts.empty()) throw std::invalid_argument("import_positions: nothing to import");
  // Past max_context (the clamp only keeps the count an int) is reported by check_write, as for a prefill.
  check_write(s, pos0, int(std::min<int64_t>(total, int64_t(layout_.max_context()) + 1)));
  const int64_t end = pos0 + total;
  const bool scales = layout_.dtype() == KvDtype::Int8;
  uint8_t* base = slot(s);
  int64_t pos = pos0;
  for (const PackedPositions& p : parts) {
    const uint8_t* in = p.data;
    const int m = p.count;
    for (int i = 0; i < layout_.num_layers(); ++i) {
      const KvLayerLayout& L = layout_.layer(i);
      if (L.layer < 0) continue;
      const uint8_t* k = in;
      const uint8_t* v = k + size_t(m) * L.row_bytes;
      const uint8_t* sc = v + size_t(m) * L.row_bytes;
      // A ring row of a position older than the last cap would be overwritten by a later one of this import.
      for (int j = int(std::max<int64_t>(0, end - L.cap - pos)); j < m; ++j) {
        const uint64_t row = uint64_t(pos + j) % L.cap;
        std::memcpy(base + L.k_off + row * L.row_bytes, k + size_t(j) * L.row_bytes, L.row_bytes);
        std::memcpy(base + L.v_off + row * L.row_bytes, v + size_t(j) * L.row_bytes, L.row_bytes);
        if (scales) {
          std::memcpy(base + L.ks_off + row * sizeof(float), sc + j * sizeof(float), sizeof(float));
          std::memcpy(base + L.vs_off + row * sizeof(float), sc + (m + j) * sizeof(float), sizeof(float));
        }
      }
      in = sc + (scales ? 2 * size_t(m) * sizeof(float) : 0);
    }
    pos += m;
  }
  mark_written(s, uint32_t(end));
}

}  // namespace sg
