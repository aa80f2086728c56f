"""Which tensors a .fgm file holds for a given text config, in which format, from which source.

This is the single place that knows the inventory (fgm-format §5): the converter fills it from a
Hugging Face checkpoint and ``random-model`` fills it with random data, so both write exactly the
published layout. Items are listed in fastgemma's emission order (§5.4); each item expands to its
tensor entries (a quantised weight is followed by its ``.scale``, then its ``.i8`` twin and scale).

Weight classes (fastgemma's defaults; ``weights`` picks the FFN format):

=====================================================  =======================================
attention q/k/v/o                                      q8c
FFN gate/up/down                                       q4g (group G); "dual" adds .i8 q8c twins;
                                                       "int8" stores them as q8c instead
lm_head (from embed_tokens.weight, tied)               q4g (group G); q8c with emb_bits 8
embed_tokens (gather table)                            q4r (group 64, never rotated); q8r with emb_bits 8
embed_tokens_per_layer (gather table)                  q4r
per_layer_model_projection / _input_gate / _projection q8c
norms, layer_scalar, rope.<type>.inv_freq              f32
=====================================================  =======================================

Gemma 3 configs have no per-layer-input tensors, no layer_scalar, and their norms are stored as 1 + w
(``Plain.offset``); a Gemma 3 model with no KV sharing has k/v on every layer.

Every linear whose K is a multiple of 128 is Hadamard-rotated (meta.hadamard 128), others not (0).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConversionError
from .hadamard import BLOCK as HADAMARD_BLOCK, rotatable
from .hf_config import TextConfig
from .quant import Q4_TABLE_GROUP, TILE_K, TILE_N
from .writer import TensorEntry

WEIGHT_MODES = ("dual", "int4", "int8")
DEFAULT_GROUP = 256
EMB_BITS = (4, 8)


@dataclass(frozen=True)
class Plain:
    """A float32 tensor copied from the checkpoint (norm weights, layer_scalar), plus ``offset``
    (Gemma 3's norms multiply by 1 + w: the file stores the multiplier)."""
    name: str
    source: str
    shape: tuple[int, ...]
    offset: float = 0.0

    def entries(self) -> list[TensorEntry]:
        return [TensorEntry(self.name, "f32", self.shape)]


@dataclass(frozen=True)
class Linear:
    """A linear weight [N, K] = [out, in]: q4g or q8c, optionally with an int8 twin."""
    name: str
    source: str
    n: int
    k: int
    dtype: str          # "q4g" or "q8c"
    group: int          # int4 scale group along K (0 for q8c)
    twin: bool = False  # also store <name>.i8 (q8c) for prefill-sized GEMMs

    @property
    def hadamard(self) -> int:
        return HADAMARD_BLOCK if rotatable(self.k) else 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def entries(self) -> list[TensorEntry]:
        meta = {"hadamard": self.hadamard, "group": self.group}
        if self.dtype == "q4g":
            out = [TensorEntry(self.name, "q4g", self.shape, meta),
                   TensorEntry(self.name + ".scale", "f16", (self.k // self.group, self.n))]
        else:
            out = [TensorEntry(self.name, "q8c", self.shape, meta),
                   TensorEntry(self.name + ".scale", "f32", (self.n,))]
        if self.twin:
            out += [TensorEntry(self.name + ".i8", "q8c", self.shape, {"hadamard": self.hadamard, "group": 0}),
                    TensorEntry(self.name + ".i8.scale", "f32", (self.n,))]
        return out

    def problems(self) -> list[str]:
        p = []
        where = f"{self.name} [{self.n}, {self.k}]"
        if self.n % TILE_N or self.k % TILE_K:
            p.append(f"{where}: tile order needs N % {TILE_N} == 0 and K % {TILE_K} == 0")
        if self.dtype == "q4g" and self.k % self.group:
            p.append(f"{where}: int4 group {self.group} does not divide K = {self.k}")
        return p


@dataclass(frozen=True)
class Table:
    """A gather table [R, K] (token embeddings): q4r (group 64) or q8r (one scale per row), unrotated."""
    name: str
    source: str
    rows: int
    k: int
    dtype: str = "q4r"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.k)

    def entries(self) -> list[TensorEntry]:
        if self.dtype == "q8r":
            return [TensorEntry(self.name, "q8r", self.shape), TensorEntry(self.name + ".scale", "f32", (self.rows,))]
        return [TensorEntry(self.name, "q4r", self.shape),
                TensorEntry(self.name + ".scale", "f16", (self.rows, self.k // Q4_TABLE_GROUP))]

    def problems(self) -> list[str]:
        if self.dtype == "q4r" and self.k % Q4_TABLE_GROUP:
            return [f"{self.name} [{self.rows}, {self.k}]: int4 table needs K % {Q4_TABLE_GROUP} == 0"]
        return []


@dataclass(frozen=True)
class Rope:
    """The RoPE inverse frequencies of one layer type (computed from the config, not read)."""
    name: str
    layer_type: str
    shape: tuple[int]

    def entries(self) -> list[TensorEntry]:
        return [TensorEntry(self.name, "f32", self.shape)]


Item = Plain | Linear | Table | Rope


def quant_bits(weights: str, emb_bits: int = 4) -> dict:
    """The header's informative ``quant`` object: the bit widths of each weight class."""
    return {"ffn": 8 if weights == "int8" else 4, "attn": 8, "ple": 4, "emb": emb_bits}


def check_options(weights: str, group: int, emb_bits: int = 4) -> None:
    if weights not in WEIGHT_MODES:
        raise ConversionError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or group % 64:
        raise ConversionError(f"group must be a positive multiple of 64, got {group!r}")
    if emb_bits not in EMB_BITS:
        raise ConversionError(f"emb_bits must be 4 or 8, got {emb_bits!r}")


def int4_ks(cfg: TextConfig, weights: str, emb_bits: int = 4) -> list[int]:
    """The K of every int4 (q4g) linear of the file: the ones an int4 group must divide."""
    ks = [] if emb_bits == 8 else [cfg.hidden_size]
    if weights != "int8":
        ks += [k for i in range(cfg.num_hidden_layers) for k in (cfg.hidden_size, cfg.layer_intermediate(i))]
    return ks


def fitting_group(cfg: TextConfig, weights: str, emb_bits: int = 4) -> int:
    """DEFAULT_GROUP when it divides every int4 K, else the largest multiple of 64 below it that does
    (Gemma 3 270M: K = 640 takes 128)."""
    ks = int4_ks(cfg, weights, emb_bits)
    for g in range(DEFAULT_GROUP, 0, -64):
        if all(k % g == 0 for k in ks):
            return g
    return DEFAULT_GROUP  # nothing fits: layout_problems() names the K that 64 does not divide


def build_inventory(cfg: TextConfig, weights: str = "dual", group: int = DEFAULT_GROUP,
                    emb_bits: int = 4) -> list[Item]:
    """All items of the file for this config, in emission order. emb_bits 8 stores the token
    embedding as q8r and the (tied) LM head as q8c instead of q4r / q4g."""
    check_options(weights, group, emb_bits)
    h, v, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    p = cfg.hidden_size_per_layer_input
    no = cfg.norm_offset
    ffn_dtype = "q8c" if weights == "int8" else "q4g"
    ffn_group = 0 if weights == "int8" else group
    ffn_twin = weights == "dual"

    def q8(name, source, n, k):
        return Linear(name, source, n, k, "q8c", 0)

    items: list[Item] = [
        Table("embed_tokens", "embed_tokens.weight", v, h, "q8r" if emb_bits == 8 else "q4r"),
        # the tied head
        Linear("lm_head", "embed_tokens.weight", v, h, "q8c", 0) if emb_bits == 8
        else Linear("lm_head", "embed_tokens.weight", v, h, "q4g", group),
    ]
    if p:
        items += [
            Table("embed_tokens_per_layer", "embed_tokens_per_layer.weight", cfg.vocab_size_per_layer_input, L * p),
            q8("per_layer_model_projection", "per_layer_model_projection.weight", L * p, h),
            Plain("per_layer_projection_norm", "per_layer_projection_norm.weight", (p,)),
        ]
    items.append(Plain("norm", "norm.weight", (h,), no))

    for i in range(L):
        pre, src = f"l{i}.", f"layers.{i}."
        hd, inter = cfg.layer_head_dim(i), cfg.layer_intermediate(i)
        q_out = cfg.num_attention_heads * hd
        kv_out = cfg.num_key_value_heads * hd
        norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"]
        items += [Plain(pre + nm, src + nm + ".weight", (h,), no) for nm in norms]
        if p:
            items.append(Plain(pre + "post_per_layer_input_norm", src + "post_per_layer_input_norm.weight", (h,)))
        if cfg.use_layer_scalar:
            items.append(Plain(pre + "layer_scalar", src + "layer_scalar", (1,)))
        items += [
            Plain(pre + "q_norm", src + "self_attn.q_norm.weight", (hd,), no),
            q8(pre + "q_proj", src + "self_attn.q_proj.weight", q_out, h),
            q8(pre + "o_proj", src + "self_attn.o_proj.weight", h, q_out),
        ]
        if cfg.owns_kv(i):
            # KV-shared layers read an earlier cache: their k/v weights (still shipped) are dead.
            items += [
                Plain(pre + "k_norm", src + "self_attn.k_norm.weight", (hd,), no),
                q8(pre + "k_proj", src + "self_attn.k_proj.weight", kv_out, h),
                q8(pre + "v_proj", src + "self_attn.v_proj.weight", kv_out, h),
            ]
        items += [
            Linear(pre + "gate_proj", src + "mlp.gate_proj.weight", inter, h, ffn_dtype, ffn_group, ffn_twin),
            Linear(pre + "up_proj", src + "mlp.up_proj.weight", inter, h, ffn_dtype, ffn_group, ffn_twin),
            Linear(pre + "down_proj", src + "mlp.down_proj.weight", h, inter, ffn_dtype, ffn_group, ffn_twin),
        ]
        if p:
            items += [
                q8(pre + "per_layer_input_gate", src + "per_layer_input_gate.weight", p, h),
                q8(pre + "per_layer_projection", src + "per_layer_projection.weight", h, p),
            ]

    for t in cfg.present_layer_types:
        items.append(Rope(f"rope.{t}.inv_freq", t, (cfg.type_head_dim(t) // 2,)))
    return items


def layout_problems(items: list[Item]) -> list[str]:
    """Every shape the format cannot hold (tile multiples, groups), one line each."""
    out = []
    for it in items:
        if isinstance(it, (Linear, Table)):
            out += it.problems()
    return out


def entries_of(items: list[Item]) -> list[TensorEntry]:
    return [e for it in items for e in it.entries()]


def probe_names(cfg: TextConfig) -> list[str]:
    """Weights whose quantisation error goes into the header's meta.quant_rel_err (as fastgemma)."""
    L = cfg.num_hidden_layers
    names = ["lm_head"]
    for i in sorted({0, L // 2, L - 1}):
        names += [f"l{i}.gate_proj", f"l{i}.down_proj"]
    return names
