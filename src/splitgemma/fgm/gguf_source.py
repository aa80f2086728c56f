"""A GGUF file (llama.cpp's format) seen as a Hugging Face Gemma 3 checkpoint: config, tensors, tokenizer.

The converter reads checkpoints through one small interface (``name in src``, ``src[name].shape`` / ``.dtype``,
``src.rows(name, r0, r1)``, ``src.release(...)``); :class:`GgufCheckpoint` offers it over a GGUF, so a GGUF goes
through the same inventory, quantisers and writer as a safetensors checkpoint. The ``gguf`` package (llama.cpp's
own reader) parses the file and dequantises every GGML type (Q4_K, Q5_0, Q6_K, Q8_0, …) to float32.

What the GGUF holds, and how it maps back (checked against transformers' GGUF loader, which reads the same file
into its Gemma 3 model, in tests/test_gemma3.py):
* tensors ``token_embd``, ``output_norm``, ``blk.<i>.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm,
  attn_k_norm, post_attention_norm, ffn_norm, ffn_gate, ffn_up, ffn_down, post_ffw_norm}`` with GGML's reversed
  shapes ([K, N] for a [N, K] weight); no ``output`` tensor means a tied LM head;
* llama.cpp's converter adds 1 to every Gemma norm weight: the file holds the multiplier 1 + w. ``rows()``
  gives back w (subtracted in float64, exact for the bf16-born values; the converter adds the 1 again), so both
  kinds of checkpoint mean the same thing to the converter;
* q/k are not permuted for Gemma (llama.cpp runs its rotate-half "NEOX" RoPE on them);
* config keys under ``gemma3.``; what llama.cpp hard-codes is filled in as it does: sliding layers every layer
  but each 6th, sliding RoPE base 10000, attention scale 1/sqrt(head_dim) (the 27B model, 62 layers, uses
  1/sqrt(hidden/heads) instead).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import ggml_blocks
from .errors import ConversionError
from .inventory import Q8gLayout

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("gemma3",)

# Hugging Face name (after the model prefix) -> GGUF name; {i} is the layer.
_GLOBAL_NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_NORM_SUFFIXES = ("norm.weight",)  # every Gemma norm: llama.cpp stored 1 + w
# Block types whose scales cover 16 values (docs/fgm-extensions.md; NVFP4 too: one E4M3 scale per 16 values): a q8g
# group holds their values exactly only if it divides 16. Every other block type scales 32 values or more at a time.
_SUB_BLOCK_16 = ("Q6_K", "Q3_K", "Q2_K", "NVFP4")
_TOKEN_TYPES = {"normal": 1, "unknown": 2, "control": 3, "user_defined": 4, "unused": 5, "byte": 6}


def ggml_sub_block(type_name: str, block_size: int) -> int | None:
    """The values one scale of a GGML type covers, as far as a q8g group is concerned: 16 for Q6_K/Q3_K/Q2_K (and
    NVFP4), 32 for every other block type, None for element types (F32, F16, BF16: block size 1), which any group fits."""
    if block_size == 1:
        return None
    return 16 if type_name in _SUB_BLOCK_16 else 32


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


@dataclass(frozen=True)
class GgufTensor:
    name: str                 # the GGUF name
    dtype: str                # the GGML type name, e.g. "Q4_K"
    shape: tuple[int, ...]    # Hugging Face order ([N, K] for a linear weight)


@dataclass(frozen=True)
class GgufTokenizer:
    """The SentencePiece vocabulary a GGUF carries (tokenizer.ggml.* keys)."""
    model: str
    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None


class GgufCheckpoint:
    """A GGUF file through the converter's checkpoint interface (names without a prefix)."""

    def __init__(self, path: str | os.PathLike):
        self.src = Path(path)
        try:
            import gguf
        except ImportError as e:  # a runtime dependency; say what to install rather than fail obscurely
            raise ConversionError(f"{self.src}: reading a GGUF needs the 'gguf' package (pip install gguf)") from e
        self._quants = gguf.quants
        self._block_sizes = {t: sizes[0] for t, sizes in gguf.GGML_QUANT_SIZES.items()}
        try:
            self._reader = gguf.GGUFReader(self.src)
        except Exception as e:  # the reader raises ValueError/KeyError/struct errors for bad files
            raise ConversionError(f"{self.src}: not a readable GGUF file, truncated or corrupt "
                                  f"({type(e).__name__}: {e})") from None
        self.arch = self._string("general.architecture")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ConversionError(f"{self.src}: GGUF architecture {self.arch!r} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self._tensors = {t.name: t for t in self._reader.tensors}
        # Every GGML type is accepted here; one the package cannot dequantise fails in rows(), by name.
        self.readable_dtypes = tuple(t.name for t in gguf.GGMLQuantizationType)
        self.n_layers = self._uint(f"{self.arch}.block_count")
        self._by_hf = dict(_GLOBAL_NAMES)
        for i in range(self.n_layers):
            for hf, g in _LAYER_NAMES.items():
                self._by_hf[f"layers.{i}.{hf}"] = f"blk.{i}.{g}"

    # -- metadata ------------------------------------------------------------------------------------------

    def _field(self, key: str, required: bool = True):
        f = self._reader.fields.get(key)
        if f is None:
            if required:
                raise ConversionError(f"{self.src}: GGUF metadata key {key!r} is missing")
            return None
        return f.contents()

    def _string(self, key: str, required: bool = True) -> str | None:
        v = self._field(key, required)
        if v is not None and not isinstance(v, str):
            raise ConversionError(f"{self.src}: GGUF metadata {key!r} must be a string, got {type(v).__name__}")
        return v

    def _uint(self, key: str, required: bool = True, default: int | None = None) -> int | None:
        v = self._field(key, required)
        if v is None:
            return default
        if isinstance(v, list):
            if not v or any(x != v[0] for x in v):
                raise ConversionError(f"{self.src}: GGUF metadata {key!r} varies per layer ({v[:8]}…): "
                                      "per-layer values are not supported")
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConversionError(f"{self.src}: GGUF metadata {key!r} must be a non-negative integer, got {v!r}")
        return v

    def _float(self, key: str, default: float | None = None) -> float | None:
        v = self._field(key, required=False)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConversionError(f"{self.src}: GGUF metadata {key!r} must be a number, got {v!r}")
        return float(v)

    def config(self) -> dict:
        """A Hugging Face Gemma 3 text config (config.json form) describing this file."""
        a = self.arch
        hidden = self._uint(f"{a}.embedding_length")
        heads = self._uint(f"{a}.attention.head_count")
        head_dim = self._uint(f"{a}.attention.key_length")
        value_dim = self._uint(f"{a}.attention.value_length", required=False, default=head_dim)
        if value_dim != head_dim:
            raise ConversionError(f"{self.src}: key_length {head_dim} differs from value_length {value_dim}")
        if "output.weight" in self._tensors:
            raise ConversionError(f"{self.src}: the GGUF has its own output.weight (an untied LM head), "
                                  "which this engine does not support")
        cfg = {
            "model_type": "gemma3_text",
            "hidden_size": hidden,
            "num_hidden_layers": self.n_layers,
            "intermediate_size": self._uint(f"{a}.feed_forward_length"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._uint(f"{a}.attention.head_count_kv", required=False, default=heads),
            "head_dim": head_dim,
            "rms_norm_eps": self._float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            "sliding_window": self._uint(f"{a}.attention.sliding_window"),
            "vocab_size": self.shape_of("embed_tokens.weight")[0],
            "rope_theta": self._float(f"{a}.rope.freq_base", 1_000_000.0),
            "rope_local_base_freq": self._float(f"{a}.rope.freq_base_swa", 10_000.0),
            # llama.cpp: 1/sqrt(head_dim), except the 62-layer 27B model's 1/sqrt(hidden/heads)
            "query_pre_attn_scalar": hidden // heads if self.n_layers == 62 else head_dim,
            "final_logit_softcapping": self._float(f"{a}.final_logit_softcapping"),
            "tie_word_embeddings": True,
        }
        pattern = self._field(f"{a}.attention.sliding_window_pattern", required=False)
        if isinstance(pattern, list):  # newer files: one bool per layer, true = sliding
            cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern is not None:
            cfg["sliding_window_pattern"] = int(pattern)
        kind = self._string(f"{a}.rope.scaling.type", required=False)
        if kind not in (None, "none"):
            cfg["rope_scaling"] = {"rope_type": kind, "factor": self._float(f"{a}.rope.scaling.factor", 1.0)}
        return cfg

    def tokenizer(self) -> GgufTokenizer:
        model = self._string("tokenizer.ggml.model")
        tokens = self._field("tokenizer.ggml.tokens")
        n = len(tokens)
        scores = self._field("tokenizer.ggml.scores", required=False) or [0.0] * n
        types = self._field("tokenizer.ggml.token_type", required=False) or [_TOKEN_TYPES["normal"]] * n
        if len(scores) != n or len(types) != n:
            raise ConversionError(f"{self.src}: the tokenizer has {n} tokens but {len(scores)} scores and "
                                  f"{len(types)} token types")

        def flag(key: str, default: bool) -> bool:
            v = self._field(key, required=False)
            return default if v is None else bool(v)

        def token_id(key: str) -> int | None:
            v = self._uint(key, required=False)
            if v is not None and v >= n:
                raise ConversionError(f"{self.src}: {key} = {v} is outside the vocabulary of {n} tokens")
            return v

        return GgufTokenizer(
            model=model, tokens=list(tokens), scores=[float(s) for s in scores], token_types=[int(t) for t in types],
            bos_id=token_id("tokenizer.ggml.bos_token_id"), eos_id=token_id("tokenizer.ggml.eos_token_id"),
            unk_id=token_id("tokenizer.ggml.unknown_token_id"), pad_id=token_id("tokenizer.ggml.padding_token_id"),
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
            add_bos=flag("tokenizer.ggml.add_bos_token", model == "llama"),
            add_eos=flag("tokenizer.ggml.add_eos_token", False),
            add_space_prefix=flag("tokenizer.ggml.add_space_prefix", False),
            chat_template=self._string("tokenizer.chat_template", required=False),
        )

    # -- tensors -------------------------------------------------------------------------------------------

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self[name].shape

    def __contains__(self, name: str) -> bool:
        return name in self._by_hf and self._by_hf[name] in self._tensors

    def __getitem__(self, name: str) -> GgufTensor:
        if name not in self:
            raise KeyError(name)
        t = self._tensors[self._by_hf[name]]
        # GGML lists dimensions innermost first: a [N, K] weight is stored as ne = [K, N].
        return GgufTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())))

    def q8g_layout(self, name: str, group: int) -> Q8gLayout:
        """The layout of the int8g tensor made from ``name`` when asked to use ``group``: the group is gcd(group, its
        GGML type's sub-block); the dtype is q8ga for the block types with a minimum (Q4_K, Q5_K, Q4_1, Q5_1:
        ggml_blocks.WITH_OFFSETS), else q8g; the scales are f16 for the types whose scale is the block's f16 d
        (ggml_blocks.F16_SCALES), else f32. Q8gLayout("q8g", group) for a float tensor or a name the file lacks (the
        converter reports a missing tensor on its own)."""
        if name not in self:
            return Q8gLayout("q8g", group)
        t = self._tensors[self._by_hf[name]]
        kind = t.tensor_type.name
        sub = ggml_sub_block(kind, self._block_sizes.get(t.tensor_type, 1))
        return Q8gLayout("q8ga" if kind in ggml_blocks.WITH_OFFSETS else "q8g",
                         group if sub is None else math.gcd(group, sub),
                         "f16" if kind in ggml_blocks.F16_SCALES else "f32")

    def q8g_rows(self, name: str, start: int, stop: int, group: int):
        """Rows [start, stop) of a tensor of a block type in ggml_blocks.EXACT_TYPES as (codes int8, scale f32,
        offset f32 or None) of q8g/q8ga groups of ``group``, checked bit for bit against the gguf package's
        dequantisation of the same rows; None for any other type (the converter then rounds rows() to int8)."""
        t = self._tensors[self._by_hf[name]]
        kind = t.tensor_type.name
        if kind not in ggml_blocks.EXACT_TYPES:
            return None
        raw = np.asarray(t.data[start:stop])
        k = self[name].shape[1]
        codes, scale, offset = ggml_blocks.q8g_groups(kind, raw, k, group)
        want = np.asarray(self._quants.dequantize(raw, t.tensor_type), dtype=np.float32).reshape(stop - start, k)
        got = ggml_blocks.values(codes, scale, offset)
        if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            bad = int(np.count_nonzero(got.view(np.uint32) != want.view(np.uint32)))
            raise ConversionError(f"{self.src}: tensor {t.name} ({kind}): {bad} of its values in rows "
                                  f"[{start}, {stop}) read from the blocks differ from the gguf package's "
                                  "dequantisation (internal error)")
        return codes, scale, offset

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of a tensor as float32, in Hugging Face form (norms as w, not 1 + w)."""
        t = self._tensors[self._by_hf[name]]
        shape = self[name].shape
        if len(shape) == 1:  # vectors are read whole
            data, out_shape = t.data, shape
        else:
            stop = shape[0] if stop is None else stop
            data, out_shape = t.data[start:stop], (stop - start,) + shape[1:]
        try:
            out = self._quants.dequantize(np.asarray(data), t.tensor_type)
        except NotImplementedError as e:
            raise ConversionError(f"{self.src}: tensor {t.name}: GGML type {t.tensor_type.name} cannot be "
                                  f"dequantised by this version of the gguf package ({e})") from None
        out = np.asarray(out, dtype=np.float32).reshape(out_shape)
        if name.endswith(_NORM_SUFFIXES):
            out = (out.astype(np.float64) - 1.0).astype(np.float32)
        return out

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Nothing to do: the reader's memory map is read-only and the kernel drops clean pages itself."""

    def close(self) -> None:
        self._reader = None
        self._tensors = {}

    def __enter__(self) -> "GgufCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
