"""Which tensors a .fgm file holds for a given text config, in which format, from which source.

This is the single place that knows the inventory (fgm-format §5): the converter fills it from a
Hugging Face checkpoint and ``random-model`` fills it with random data, so both write exactly the
published layout. Items are listed in fastgemma's emission order (§5.4); each item expands to its
tensor entries (a quantised weight is followed by its ``.scale``, then its ``.i8`` twin and scale).

Weight classes (fastgemma's defaults; ``weights`` picks the FFN format, or "int8g" every linear's):

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

"int8g" (docs/fgm-extensions.md) stores every linear above and the embed_tokens table as q8g (int8, one f32 scale
per row and group of G inputs, f16 where a GGUF's blocks hold it so, unrotated, no .i8 twins); that table is also
the tied LM head, so there is no lm_head tensor. embed_tokens_per_layer stays q4r.
A tensor's group may be smaller than G when its source says so (a GGUF block type: gguf_source.ggml_sub_block).

Gemma 3 configs have no per-layer-input tensors, no layer_scalar, and their norms are stored as 1 + w
(``Plain.offset``); a Gemma 3 model with no KV sharing has k/v on every layer.

Every q8c/q4g linear whose K is a multiple of 128 is Hadamard-rotated (meta.hadamard 128), others not (0);
q8g is never rotated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from .errors import ConversionError
from .hadamard import BLOCK as HADAMARD_BLOCK, rotatable
from .hf_config import TextConfig
from .quant import Q4_TABLE_GROUP, TILE_K, TILE_N
from .writer import TensorEntry

WEIGHT_MODES = ("dual", "int4", "int8", "int8g")
DEFAULT_GROUP = 256      # the int4 scale group (dual, int4, and an int4 LM head)
DEFAULT_Q8G_GROUP = 32   # the int8g scale group: a GGUF's Q8_0/Q5_0/Q4_0 block
EMB_BITS = (4, 8)
PANELED = ("q8g", "q8ga")  # the 16-column panel types; q8ga adds one f32 offset per group (a GGUF's minimums)


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


class Q8gLayout(NamedTuple):
    """How an int8g tensor is stored: q8g or q8ga, its scale group, and its scales' dtype: "f32", or "f16" where the
    source's scales are f16 already (a GGUF's Q8_0, Q5_0, …: half the bytes, the same values)."""
    dtype: str
    group: int
    scale_dtype: str = "f32"


@dataclass(frozen=True)
class Linear:
    """A linear weight [N, K] = [out, in]: q4g, q8c, q8g or q8ga, optionally (q4g) with an int8 twin."""
    name: str
    source: str
    n: int
    k: int
    dtype: str          # "q4g", "q8c", "q8g" or "q8ga"
    group: int          # scale group along K (0 for q8c)
    twin: bool = False  # also store <name>.i8 (q8c) for prefill-sized GEMMs
    scale_dtype: str = "f32"  # q8g/q8ga: "f32" or "f16" (Q8gLayout)

    @property
    def hadamard(self) -> int:
        return HADAMARD_BLOCK if self.dtype not in PANELED and rotatable(self.k) else 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def entries(self) -> list[TensorEntry]:
        meta = {"hadamard": self.hadamard, "group": self.group}
        if self.dtype == "q4g":
            out = [TensorEntry(self.name, "q4g", self.shape, meta),
                   TensorEntry(self.name + ".scale", "f16", (self.k // self.group, self.n))]
        elif self.dtype in PANELED:
            out = q8g_entries(self.name, self.n, self.k, self.group, self.dtype, self.scale_dtype)
        else:
            out = [TensorEntry(self.name, "q8c", self.shape, meta),
                   TensorEntry(self.name + ".scale", "f32", (self.n,))]
        if self.twin:
            out += [TensorEntry(self.name + ".i8", "q8c", self.shape, {"hadamard": self.hadamard, "group": 0}),
                    TensorEntry(self.name + ".i8.scale", "f32", (self.n,))]
        return out

    def problems(self) -> list[str]:
        if self.dtype in PANELED:
            return q8g_problems(self.name, self.n, self.k, self.group)
        p = []
        where = f"{self.name} [{self.n}, {self.k}]"
        if self.n % TILE_N or self.k % TILE_K:
            p.append(f"{where}: tile order needs N % {TILE_N} == 0 and K % {TILE_K} == 0")
        if self.dtype == "q4g" and self.k % self.group:
            p.append(f"{where}: int4 group {self.group} does not divide K = {self.k}")
        return p


def q8g_entries(name: str, n: int, k: int, group: int, dtype: str = "q8g",
                scale_dtype: str = "f32") -> list[TensorEntry]:
    """A q8g weight and its f32 (or f16) scales, stored transposed [K/G, N]; a q8ga one also its f32 offsets,
    alike."""
    out = [TensorEntry(name, dtype, (n, k), {"hadamard": 0, "group": group}),
           TensorEntry(name + ".scale", scale_dtype, (k // group, n))]
    if dtype == "q8ga":
        out.append(TensorEntry(name + ".offset", "f32", (k // group, n)))
    return out


def q8g_problems(name: str, n: int, k: int, group: int) -> list[str]:
    p = []
    where = f"{name} [{n}, {k}]"
    if n % TILE_N:
        p.append(f"{where}: q8g panels need N % {TILE_N} == 0")
    if k % group:
        p.append(f"{where}: int8 group {group} does not divide K = {k}")
    return p


@dataclass(frozen=True)
class Table:
    """A gather table [R, K] (token embeddings), unrotated: q4r (group 64), q8r (one scale per row) or q8g
    (one scale per row and group of ``group``, in the panel layout of a q8g linear)."""
    name: str
    source: str
    rows: int
    k: int
    dtype: str = "q4r"
    group: int = 0      # q8g/q8ga only
    scale_dtype: str = "f32"  # q8g/q8ga: "f32" or "f16" (Q8gLayout)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.k)

    def entries(self) -> list[TensorEntry]:
        if self.dtype in PANELED:
            return q8g_entries(self.name, self.rows, self.k, self.group, self.dtype, self.scale_dtype)
        if self.dtype == "q8r":
            return [TensorEntry(self.name, "q8r", self.shape), TensorEntry(self.name + ".scale", "f32", (self.rows,))]
        return [TensorEntry(self.name, "q4r", self.shape),
                TensorEntry(self.name + ".scale", "f16", (self.rows, self.k // Q4_TABLE_GROUP))]

    def problems(self) -> list[str]:
        if self.dtype in PANELED:
            return q8g_problems(self.name, self.rows, self.k, self.group)
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


def quant_bits(weights: str, emb_bits: int | None = None) -> dict:
    """The header's informative ``quant`` object: the bit widths of each weight class."""
    emb_bits = resolve_emb_bits(weights, emb_bits)
    return {"ffn": 8 if weights in ("int8", "int8g") else 4, "attn": 8, "ple": 4, "emb": emb_bits}


def resolve_emb_bits(weights: str, emb_bits: int | None) -> int:
    """emb_bits not given: 8 for int8g (its embedding and LM head are q8g), else 4 (fastgemma's default)."""
    if emb_bits is None:
        return 8 if weights == "int8g" else 4
    return emb_bits


def header_hadamard(weights: str) -> int:
    """The header's informative config.hadamard: 0 when the mode rotates nothing (int8g), else 128."""
    return 0 if weights == "int8g" else HADAMARD_BLOCK


def header_kv_cache_dtype(weights: str) -> str | None:
    """The K/V cache element type the file asks the engine for (config.kv_cache_dtype, docs/fgm-extensions.md):
    f16 for int8g, whose point is precision (an int8 K cache costs Gemma 3 270M 2 points of top-1 agreement with
    transformers, f16 nothing measurable); None (the engine's int8) otherwise, as fastgemma's files."""
    return "f16" if weights == "int8g" else None


def default_group(weights: str) -> int:
    """The scale group when none is asked for: int8g's 32, else the int4 default."""
    return DEFAULT_Q8G_GROUP if weights == "int8g" else DEFAULT_GROUP


def check_options(weights: str, group: int, emb_bits: int | None = None) -> None:
    if weights not in WEIGHT_MODES:
        raise ConversionError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0:
        raise ConversionError(f"group must be a positive integer, got {group!r}")
    if weights != "int8g" and group % 64:
        raise ConversionError(f"group must be a positive multiple of 64 with --weights {weights} "
                              f"(any divisor of every K only with int8g), got {group!r}")
    if emb_bits is not None and emb_bits not in EMB_BITS:
        raise ConversionError(f"emb_bits must be 4 or 8, got {emb_bits!r}")
    if weights == "int8g" and emb_bits == 4:
        raise ConversionError("emb_bits 4 does not go with --weights int8g, which stores the token embedding "
                              "and the LM head as q8g (int8)")


def int4_ks(cfg: TextConfig, weights: str, emb_bits: int = 4) -> list[int]:
    """The K of every int4 (q4g) linear of the file: the ones an int4 group must divide."""
    if weights == "int8g":
        return []
    ks = [] if emb_bits == 8 else [cfg.hidden_size]
    if weights != "int8":
        ks += [k for i in range(cfg.num_hidden_layers) for k in (cfg.hidden_size, cfg.layer_intermediate(i))]
    return ks


def fitting_group(cfg: TextConfig, weights: str, emb_bits: int | None = None) -> int:
    """For int4 groups, DEFAULT_GROUP when it divides every int4 K, else the largest multiple of 64 below it that
    does (Gemma 3 270M: K = 640 takes 128). For int8g, DEFAULT_Q8G_GROUP."""
    if weights == "int8g":
        return DEFAULT_Q8G_GROUP
    ks = int4_ks(cfg, weights, resolve_emb_bits(weights, emb_bits))
    for g in range(DEFAULT_GROUP, 0, -64):
        if all(k % g == 0 for k in ks):
            return g
    return DEFAULT_GROUP  # nothing fits: layout_problems() names the K that 64 does not divide


def build_inventory(cfg: TextConfig, weights: str = "dual", group: int = DEFAULT_GROUP,
                    emb_bits: int | None = None,
                    layout_of: Callable[[str], Q8gLayout] | None = None) -> list[Item]:
    """All items of the file for this config, in emission order. emb_bits 8 stores the token
    embedding as q8r and the (tied) LM head as q8c instead of q4r / q4g (default 4); int8g stores both q8g
    (emb_bits None or 8).

    layout_of (int8g only): the Q8gLayout of the tensor made from a given source name, when the source constrains
    it (a GGUF block type: q8ga for blocks with minimums, the group, f16 scales where the blocks' are); default
    Q8gLayout("q8g", ``group``).
    """
    check_options(weights, group, emb_bits)
    emb_bits = resolve_emb_bits(weights, emb_bits)
    h, v, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    p = cfg.hidden_size_per_layer_input
    no = cfg.norm_offset
    ffn_dtype = "q8c" if weights == "int8" else "q4g"
    ffn_group = 0 if weights == "int8" else group
    ffn_twin = weights == "dual"

    def q8g_layout(source) -> Q8gLayout:
        return Q8gLayout("q8g", group) if layout_of is None else layout_of(source)

    def q8(name, source, n, k):
        """The int8 linears: q8c, or q8g/q8ga with int8g."""
        if weights == "int8g":
            lay = q8g_layout(source)
            return Linear(name, source, n, k, lay.dtype, lay.group, scale_dtype=lay.scale_dtype)
        return Linear(name, source, n, k, "q8c", 0)

    def ffn(name, source, n, k):
        if weights == "int8g":
            return q8(name, source, n, k)
        return Linear(name, source, n, k, ffn_dtype, ffn_group, ffn_twin)

    if weights == "int8g":
        emb = "embed_tokens.weight"
        # one q8g table is both the embedding and the tied LM head (no lm_head tensor: docs/fgm-extensions.md)
        lay = q8g_layout(emb)
        items: list[Item] = [Table("embed_tokens", emb, v, h, lay.dtype, lay.group, lay.scale_dtype)]
    else:
        items = [
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
            ffn(pre + "gate_proj", src + "mlp.gate_proj.weight", inter, h),
            ffn(pre + "up_proj", src + "mlp.up_proj.weight", inter, h),
            ffn(pre + "down_proj", src + "mlp.down_proj.weight", h, inter),
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
    names = ["lm_head", "embed_tokens"]  # embed_tokens only counts where it is q8g (int8g: the tied head itself)
    for i in sorted({0, L // 2, L - 1}):
        names += [f"l{i}.gate_proj", f"l{i}.down_proj"]
    return names
