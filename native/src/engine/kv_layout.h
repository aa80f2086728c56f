// The KV slot: one sequence's K/V cache in caller-provided memory, defined once here.
//
// A slot is a flat byte range holding only offsets (no pointers), so two processes that map the same shared memory
// and the same .fgm agree on it: the prefill worker writes a prompt's K/V into a slot, the decode worker reads it.
//
//   [0, 128)           SlotHeader (magic, model layout signature, geometry, request id, generation, token count,
//                      checksum of the written K/V, the live lease's digest)
//   per KV layer i (only layers < first_shared_layer store K/V; the shared layers read their producer's):
//     K codes   int8 [cap_i][nkv * hd_i]   post-norm, post-RoPE keys, row = position slot
//     V codes   int8 [cap_i][nkv * hd_i]   post-norm values
//     (both rotated per head, before quantisation, by the orthonormal Walsh–Hadamard transform in blocks of
//      ops::kv_rotation_block(hd) = the largest power of two dividing hd, at most 128: the rotation spreads a
//      head's outlier dimensions over the block, so the shared int8 scale loses less; queries are rotated alike)
//     K scales  f32  [cap_i]               one scale per position, shared over the KV heads (value = code * scale)
//     V scales  f32  [cap_i]
//   or, with the f16 element type, K and V as f16 [cap_i][nkv * hd_i] (not rotated) and no scales: twice the bytes,
//   and no quantisation error (int8 K costs small models with sharp attention most of their accuracy); or with f32,
//   K and V as the f32 rows the forward pass computed (not rotated, no scales: four times the bytes; for fidelity
//   checks, where even f16's rounding should not be in the way).
//   every array starts on a 64-byte boundary relative to the slot start.
//
// Position p of layer i lives in row p % cap_i. Full-attention layers have cap = max_context (so the row is p).
// Sliding layers have a ring of cap = sliding_window + chunk (or max_context if that is smaller): a prefill chunk
// writes all its rows before any of them attends, so the ring must still hold the window of the chunk's first row
// after the chunk's last row was written (fastgemma's bug B); readers map through the ring too (bug A).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fgm_file.h"

namespace sg {

// '2': K/V rotated (an older slot's codes would be misread, so its magic no longer matches). '3': 128-byte header
// with the lease digest.
constexpr char kSlotMagic[8] = {'S', 'G', 'K', 'V', 'S', 'L', 'T', '3'};
constexpr size_t kLeaseDigestBytes = 32;
constexpr uint32_t kSlotSealed = 1u;  // SlotHeader::flags: checksum matches the K/V as written

// The K/V element type; SlotHeader::flags bits 8-15 record it.
enum class KvDtype : uint8_t { Int8 = 0, F16 = 1, F32 = 2 };
const char* kv_dtype_name(KvDtype d);
KvDtype kv_dtype_from_name(const std::string& name);  // "int8" | "f16" | "f32"; throws std::invalid_argument
inline int kv_element_bytes(KvDtype d) { return d == KvDtype::F32 ? 4 : d == KvDtype::F16 ? 2 : 1; }

// Little-endian, 128 bytes, no padding; written by whoever writes the slot's K/V, except generation and
// lease_digest, which are the slot owner's (stamp_lease) and survive every write.
struct SlotHeader {
  char magic[8];
  uint64_t model_signature;  // FgmFile::layout_signature() of the model that wrote the K/V
  uint64_t request_id;       // stamped by seal()
  uint64_t generation;       // the lease generation: stamped by the lease owner (stamp_lease) and by seal()
  uint32_t n_tokens;         // positions [0, n_tokens) hold valid K/V
  uint32_t max_context;      // geometry the slot was laid out with
  uint32_t chunk;            // ring headroom the slot was laid out with
  uint32_t flags;            // kSlotSealed | KvDtype << 8
  uint64_t checksum;         // kv_checksum() at seal time
  uint64_t slot_bytes;
  // A keyed digest of the live lease's secret (splitgemma/serving/shm_arena.py lease_digest), stamped with the
  // generation: a prefill writes only when the secret it was given yields it. Zeros when no lease may write.
  uint8_t lease_digest[kLeaseDigestBytes];
  uint8_t reserved[32];
};
static_assert(sizeof(SlotHeader) == 128, "SlotHeader must stay 128 bytes");

struct KvLayerLayout {
  int layer = -1;    // -1: this layer stores nothing
  int cap = 0;       // rows (positions) held
  int row_bytes = 0; // nkv * head_dim * element size
  uint64_t k_off = 0, v_off = 0, ks_off = 0, vs_off = 0;  // from the slot start (f16/f32: no scales, ks/vs_off 0)
};

class KvLayout {
 public:
  KvLayout() = default;
  // max_context: longest sequence a slot holds; chunk: most rows one forward call writes into a slot.
  KvLayout(const FgmFile& file, int max_context, int chunk, KvDtype dtype = KvDtype::Int8);

  uint64_t slot_bytes() const { return slot_bytes_; }
  int max_context() const { return max_context_; }
  int chunk() const { return chunk_; }
  int sliding_window() const { return window_; }
  uint64_t model_signature() const { return model_sig_; }
  KvDtype dtype() const { return dtype_; }
  const KvLayerLayout& layer(int i) const { return layers_[i]; }  // by model layer index
  int num_layers() const { return int(layers_.size()); }
  // Bytes one position takes in an export (export_positions): every KV layer's K row, V row and (int8) scales.
  uint64_t position_bytes() const { return position_bytes_; }
  bool same_as(const KvLayout& o) const {
    return model_sig_ == o.model_sig_ && max_context_ == o.max_context_ && chunk_ == o.chunk_ &&
           dtype_ == o.dtype_ && slot_bytes_ == o.slot_bytes_;
  }
  // Empty when a slot holding n_tokens positions can take new tokens from position pos on (pos <= n_tokens, and
  // every ring still holds the window pos needs); otherwise the reason.
  std::string resume_error(uint32_t n_tokens, int pos) const;

 private:
  uint64_t model_sig_ = 0;
  int max_context_ = 0, chunk_ = 0, window_ = 0;
  KvDtype dtype_ = KvDtype::Int8;
  std::vector<KvLayerLayout> layers_;
  std::vector<bool> sliding_;
  uint64_t slot_bytes_ = 0, position_bytes_ = 0;
};

// Packed K/V of `count` consecutive positions, as export_positions writes it: for each KV layer in layer order,
// K rows [count][row_bytes], V rows [count][row_bytes], then (int8 only) K scales f32[count], V scales f32[count].
// Independent of max_context and chunk (no ring rows), so it is the unit a prefix cache stores.
struct PackedPositions {
  const uint8_t* data;
  int count;
};

// A view over n_slots consecutive slots in caller-owned memory (e.g. POSIX shared memory). Not owning.
class KvArena {
 public:
  KvArena(const KvLayout& layout, uint8_t* base, size_t bytes, int n_slots);

  const KvLayout& layout() const { return layout_; }
  int n_slots() const { return n_slots_; }
  uint8_t* slot(int s) const { return base_ + uint64_t(s) * layout_.slot_bytes(); }
  SlotHeader* header(int s) const { return reinterpret_cast<SlotHeader*>(slot(s)); }
  void check_slot(int s) const;  // throws std::out_of_range

  // True when the header says the slot was written for this layout (magic, signature, geometry).
  bool header_matches(int s) const;
  // Positions with valid K/V (0 when the header is not this layout's).
  uint32_t n_tokens(int s) const { return header_matches(s) ? header(s)->n_tokens : 0; }
  // Throws std::invalid_argument when writing tokens at [pos, pos + count) would read K/V that is not there.
  void check_write(int s, int pos, int count) const;
  // Called after K/V for positions up to n_tokens-1 were written: stamps the layout, clears the seal. The lease
  // generation stamp survives (a writer checks it before writing: services/decode/slots.py).
  void mark_written(int s, uint32_t n_tokens);
  // The slot's owner (the decode worker) records which lease may write it: the generation of the live lease and the
  // digest of its secret, or 0 and zeros when none may (revoked). A prefill checks both, under the slot's writer
  // lock, before it writes anything.
  void stamp_lease(int s, uint64_t generation, const uint8_t (&digest)[kLeaseDigestBytes]);

  // 64-bit checksum of the live K/V (for every layer the last min(cap, n_tokens) positions, in position order).
  uint64_t kv_checksum(int s) const;
  void seal(int s, uint64_t request_id, uint64_t generation);
  // Throws std::invalid_argument naming the first mismatch (layout, ids, unsealed, checksum).
  void verify(int s, uint64_t request_id, uint64_t generation, bool check_ids) const;
  void reset(int s);  // zero the header: the slot holds nothing
  // Copies slot src_slot of src (same layout; may be this arena) into slot s, header included but unsealed and with
  // s's own lease stamp kept: the copy holds the same positions and can be extended from there (prefix reuse).
  void copy_slot(int s, const KvArena& src, int src_slot);
  // Writes the K/V of positions [begin, end) into out (count * layout().position_bytes() bytes, packed as
  // PackedPositions). Throws std::invalid_argument unless the slot holds every one of them in every layer (end <=
  // n_tokens, and no sliding ring has overwritten begin yet).
  void export_positions(int s, int begin, int end, uint8_t* out) const;
  void check_export(int s, int begin, int end) const;  // the checks of export_positions (throws), nothing written
  // Writes exported positions back, the parts one after another from position pos0 (pos0 <= n_tokens, with the
  // rewind rules of check_write), and sets n_tokens to their end (unsealed). A sliding layer gets only the positions
  // its ring holds at that end (the last cap), so the live K/V equals what a prefill of the same positions leaves.
  void import_positions(int s, int pos0, const std::vector<PackedPositions>& parts);

 private:
  KvLayout layout_;
  uint8_t* base_;
  int n_slots_;
};

}  // namespace sg
