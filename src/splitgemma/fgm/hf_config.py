"""The Gemma 4 (or Gemma 3) text-decoder config, read from a Hugging Face ``config.json``.

Two architectures share one forward pass and differ only in configuration:
* Gemma 4 (``model_type`` gemma4 / gemma4_text, or none): attention scale 1, v-norm, layer scalar, per-layer
  inputs, KV sharing, norms multiply by ``w``.
* Gemma 3 (``model_type`` gemma3 / gemma3_text): attention scale ``query_pre_attn_scalar``^-1/2, no v-norm, no
  layer scalar, no per-layer inputs, no KV sharing, one head dim, norms multiply by ``1 + w`` (the converter
  stores ``1 + w``, so the engine multiplies by the stored weight either way), RoPE θ per layer type from
  ``rope_theta`` / ``rope_local_base_freq`` (or ``rope_parameters``), ``rope_scaling`` on full layers.
  (Gemma 3n, model_type gemma3n, is a different architecture and is not accepted.)

Accepted spellings for Gemma 4 (all seen in the wild):
* decoder fields nested under ``text_config`` (Google's multimodal config) or at the top level
  (a text-only ``Gemma4ForCausalLM`` / ``Gemma4TextConfig`` save);
* the full-attention head dim as ``global_head_dim`` (Google's file) or as
  ``per_layer_config: {"<layer>": {"head_dim": …}}`` (what transformers 5.23 writes back);
* ``rope_parameters`` per layer type, ``default`` or ``proportional`` (with ``partial_rotary_factor``)
  or ``linear`` (with ``factor``).

Missing optional fields take transformers' Gemma4TextConfig defaults, so a config means here what it
means to transformers. Features this engine cannot run (MoE, k=v attention, biases, per-layer KV-head
overrides, untied embeddings, bidirectional attention) are refused with a precise message.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ConversionError

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

# transformers' Gemma4TextConfig defaults for fields a config may leave out.
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_DEFAULT_GLOBAL_HEAD_DIM = 512
_SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")

GEMMA4 = "gemma4"
GEMMA3 = "gemma3"
_GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text")
# transformers' Gemma3TextConfig defaults.
_GEMMA3_DEFAULTS = {"query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}


@dataclass(frozen=True)
class TextConfig:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    layer_types: tuple[str, ...]
    vocab_size: int
    vocab_size_per_layer_input: int
    hidden_size_per_layer_input: int
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    sliding_window: int = 512
    rope_parameters: dict = field(default_factory=lambda: {k: dict(v) for k, v in _DEFAULT_ROPE.items()})
    # Where Gemma 3 differs from Gemma 4 (the defaults are Gemma 4's).
    architecture: str = GEMMA4
    norm_offset: float = 0.0        # stored norm weight = checkpoint weight + this (Gemma 3: 1, its 1 + w)
    attention_scale: float = 1.0    # multiplies q·k (Gemma 3: query_pre_attn_scalar^-1/2)
    use_v_norm: bool = True         # weightless RMSNorm of v per head
    use_layer_scalar: bool = True   # each layer's output × its layer_scalar

    # -- derived per-layer facts -----------------------------------------------------------------

    @property
    def first_shared_layer(self) -> int:
        """Layers at or after this index compute no K/V; they read an earlier layer's cache."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def store_full_length_kv(self) -> list[int]:
        """For each layer type, the last layer of that type before the first shared layer (sorted)."""
        fs = self.first_shared_layer
        last = {t: i for i, t in enumerate(self.layer_types[:fs])}
        return sorted(last.values())

    def owns_kv(self, i: int) -> bool:
        return i < self.first_shared_layer

    def layer_head_dim(self, i: int) -> int:
        return self.global_head_dim if self.layer_types[i] == FULL else self.head_dim

    def layer_intermediate(self, i: int) -> int:
        wide = self.use_double_wide_mlp and not self.owns_kv(i)
        return self.intermediate_size * (2 if wide else 1)

    def type_head_dim(self, layer_type: str) -> int:
        return self.global_head_dim if layer_type == FULL else self.head_dim

    @property
    def present_layer_types(self) -> list[str]:
        """The distinct layer types, sorted (the order of the rope tensors in the file)."""
        return sorted(set(self.layer_types))

    # -- RoPE ------------------------------------------------------------------------------------

    def rope_inv_freq(self, layer_type: str) -> np.ndarray:
        """The inverse frequencies of one layer type (float32, head_dim/2 values; fgm-format §5.3).

        Computed in float64 and rounded once. Proportional RoPE rotates the first
        ⌊p·d/2⌋ frequency pairs and leaves the rest (zeros) unrotated; ``factor`` divides all.
        """
        d = self.type_head_dim(layer_type)
        p = self.rope_parameters[layer_type]
        theta = float(p["rope_theta"])
        half = d // 2
        kind = p.get("rope_type", "default")
        n = int(float(p.get("partial_rotary_factor", 1.0)) * d // 2) if kind == "proportional" else half
        inv = np.zeros(half, dtype=np.float64)
        inv[:n] = 1.0 / theta ** (np.arange(0, 2 * n, 2, dtype=np.float64) / d)
        if kind in ("proportional", "linear"):
            inv /= float(p.get("factor", 1.0))
        return inv.astype(np.float32)

    # -- the .fgm header ------------------------------------------------------------------------

    def fgm_config(self, *, hadamard: int, group: int, quant: dict, kv_cache_dtype: str | None = None) -> dict:
        """The header ``config`` object, with fastgemma's keys in fastgemma's order (fgm-format §6), then ours
        (absent unless they differ from what a fastgemma file means)."""
        h, ple = self.hidden_size, self.hidden_size_per_layer_input
        cfg = {
            "hidden_size": h,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "use_double_wide_mlp": self.use_double_wide_mlp,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "global_head_dim": self.global_head_dim,
            "layer_types": list(self.layer_types),
            "first_shared_layer": self.first_shared_layer,
            "store_full_length_kv": self.store_full_length_kv,
            "hidden_size_per_layer_input": ple,
            "vocab_size": self.vocab_size,
            "vocab_size_per_layer_input": self.vocab_size_per_layer_input,
            "rms_norm_eps": self.rms_norm_eps,
            "final_logit_softcapping": self.final_logit_softcapping,
            "sliding_window": self.sliding_window,
            # float64, exactly as fastgemma (x ** ±0.5); the engine multiplies by these.
            "embed_scale": h ** 0.5,
            "ple_embed_scale": ple ** 0.5,
            "ple_model_projection_scale": h ** -0.5,
            "ple_input_scale": 2 ** -0.5,
            "hadamard": hadamard,
            "group": group,
            "quant": dict(quant),
        }
        if self.architecture != GEMMA4:
            # Keys a Gemma 4 file leaves out (absent means Gemma 4), so fastgemma's headers stay as they are.
            cfg.update({
                "model_type": self.architecture,
                "attention_scale": self.attention_scale,
                "use_v_norm": self.use_v_norm,
                "use_layer_scalar": self.use_layer_scalar,
                # Informative: the stored norm weights already include this offset (1 + w); the engine
                # multiplies by them as stored.
                "norm_offset": self.norm_offset,
            })
        if kv_cache_dtype is not None:
            cfg["kv_cache_dtype"] = kv_cache_dtype
        return cfg


# ----------------------------------------------------------------------------------------------
# Parsing


def _int(d: dict, key: str, problems: list[str], default=None, minimum: int = 1):
    v = d.get(key, default)
    if v is None:
        problems.append(f"'{key}' is missing")
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        problems.append(f"'{key}' must be an integer ≥ {minimum}, got {v!r}")
        return 0
    return v


def _core_fields(raw: dict, d: dict, problems: list[str]) -> tuple[int, int, int, int, int, int, int]:
    """What Gemma 4 and Gemma 3 require alike: tied embeddings, tanh-GELU, and the core dimensions
    (hidden_size, num_hidden_layers, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
    vocab_size), returned in that order (0 for an invalid one, with its problem recorded)."""
    if d.get("tie_word_embeddings", raw.get("tie_word_embeddings", True)) is False:
        problems.append("tie_word_embeddings is false: the LM head is always derived from embed_tokens")
    act = d.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in _SUPPORTED_ACTIVATIONS:
        problems.append(f"hidden_activation '{act}' is not supported (the engine implements tanh-GELU)")
    return (_int(d, "hidden_size", problems), _int(d, "num_hidden_layers", problems),
            _int(d, "intermediate_size", problems), _int(d, "num_attention_heads", problems),
            _int(d, "num_key_value_heads", problems), _int(d, "head_dim", problems, minimum=2),
            _int(d, "vocab_size", problems))


def _check_head_grouping(heads: int, kv_heads: int, problems: list[str]) -> None:
    # Separate from _core_fields: each parser reads its own extra fields first, and the problems keep that order.
    if heads and kv_heads and heads % kv_heads:
        problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")


def _checked_layer_types(layer_types, layers: int, problems: list[str]) -> list[str]:
    """``layer_types`` as a new list; one type per layer (all sliding, with a problem, if not) and each a known type."""
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        problems.append(f"'layer_types' must list one type per layer ({layers})")
        layer_types = [SLIDING] * layers
    bad = sorted({str(t) for t in layer_types if t not in LAYER_TYPES})
    if bad:
        problems.append(f"layer_types contains {bad}; only {list(LAYER_TYPES)} exist")
    return list(layer_types)


def _eps_and_softcap(d: dict, problems: list[str]) -> tuple[float, float | None]:
    """``rms_norm_eps`` and ``final_logit_softcapping`` (an invalid value is recorded as a problem, so the
    placeholder returned for it is never used)."""
    # The ranges the .fgm reader accepts (docs/fgm-extensions.md, "Ranges"): refused here rather than written.
    eps = d.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 1e-30 <= eps <= 1:
        problems.append(f"rms_norm_eps must be a number in [1e-30, 1], got {eps!r}")
        eps = 1.0
    cap = d.get("final_logit_softcapping")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 1e-2 <= cap <= 1e6):
        problems.append(f"final_logit_softcapping must be a number in [0.01, 1e6] or null, got {cap!r}")
        cap = None
    return float(eps), None if cap is None else float(cap)


def _global_head_dim(d: dict, layer_types: list[str], head_dim: int, problems: list[str]) -> int:
    if d.get("global_head_dim") is not None:
        v = d["global_head_dim"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            problems.append(f"'global_head_dim' must be an integer ≥ 2, got {v!r}")
            return 0
        return v
    plc = d.get("per_layer_config")
    if plc is None:
        return _DEFAULT_GLOBAL_HEAD_DIM
    if not isinstance(plc, dict):
        problems.append("'per_layer_config' must be an object {layer: {field: value}}")
        return 0
    dims = set()
    for key, over in plc.items():
        try:
            i = int(key)
        except (TypeError, ValueError):
            problems.append(f"per_layer_config key {key!r} is not a layer index")
            continue
        if not 0 <= i < len(layer_types) or not isinstance(over, dict):
            problems.append(f"per_layer_config[{key!r}] does not describe a layer of this model")
            continue
        unsupported = sorted(set(over) - {"head_dim"})
        if unsupported:
            problems.append(f"per_layer_config[{key!r}] overrides {unsupported}: only 'head_dim' is supported")
        if "head_dim" in over:
            if layer_types[i] == FULL:
                dims.add(over["head_dim"])
            elif over["head_dim"] != head_dim:
                problems.append(f"per_layer_config[{key!r}] gives sliding layer {i} head_dim "
                                f"{over['head_dim']}, but sliding layers use head_dim {head_dim}")
    if len(dims) > 1:
        problems.append(f"per_layer_config gives full-attention layers different head dims {sorted(dims)}")
        return 0
    if not dims:
        return head_dim if FULL not in layer_types else _DEFAULT_GLOBAL_HEAD_DIM
    (v,) = dims
    if isinstance(v, bool) or not isinstance(v, int) or v < 2:
        problems.append(f"per_layer_config head_dim must be an integer ≥ 2, got {v!r}")
        return 0
    return v


def _rope_parameters(d: dict, layer_types: list[str], problems: list[str]) -> dict:
    rp = d.get("rope_parameters")
    if rp is None:
        return {k: dict(v) for k, v in _DEFAULT_ROPE.items()}
    if not isinstance(rp, dict):
        problems.append("'rope_parameters' must be an object keyed by layer type")
        return {}
    out = {}
    for t in sorted(set(layer_types)):
        p = rp.get(t)
        if not isinstance(p, dict):
            problems.append(f"rope_parameters has no entry for layer type '{t}'")
            continue
        kind = p.get("rope_type", "default")
        theta = p.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
            problems.append(f"rope_parameters['{t}'].rope_theta must be a number > 1, got {theta!r}")
        if kind not in ("default", "proportional", "linear"):
            problems.append(f"rope_parameters['{t}'] has rope_type '{kind}': only default, linear and "
                            "proportional RoPE can be stored as inverse frequencies")
        prf = p.get("partial_rotary_factor", 1.0)
        if kind == "proportional":
            if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 <= prf <= 1:
                problems.append(f"rope_parameters['{t}'].partial_rotary_factor must lie in [0, 1], got {prf!r}")
        elif prf != 1.0:
            problems.append(f"rope_parameters['{t}']: partial_rotary_factor {prf} is only supported with "
                            "rope_type 'proportional'")
        factor = p.get("factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            problems.append(f"rope_parameters['{t}'].factor must be a positive number, got {factor!r}")
        out[t] = dict(p)
    return out


def parse_text_config(raw: dict, source: str = "config.json") -> TextConfig:
    """Build a TextConfig from a parsed config.json; every problem is reported in one error."""
    if not isinstance(raw, dict):
        raise ConversionError(f"{source}: not a JSON object")
    d = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    if d.get("model_type", raw.get("model_type")) in _GEMMA3_MODEL_TYPES:
        return _parse_gemma3(raw, d, source)
    problems: list[str] = []

    if d.get("enable_moe_block"):
        problems.append("enable_moe_block is true: mixture-of-experts Gemma 4 models are not supported")
    if d.get("attention_k_eq_v"):
        problems.append("attention_k_eq_v is true: shared key/value projections are not supported")
    if d.get("attention_bias"):
        problems.append("attention_bias is true: linear biases are not supported")
    if d.get("use_bidirectional_attention") == "all":
        problems.append("use_bidirectional_attention 'all' (non-causal text attention) is not supported")

    hidden, layers, inter, heads, kv_heads, head_dim, vocab = _core_fields(raw, d, problems)
    ple_vocab = _int(d, "vocab_size_per_layer_input", problems, default=d.get("vocab_size"))
    ple = _int(d, "hidden_size_per_layer_input", problems, default=256, minimum=0)
    shared = _int(d, "num_kv_shared_layers", problems, default=0, minimum=0)
    window = _int(d, "sliding_window", problems, default=512)
    _check_head_grouping(heads, kv_heads, problems)
    gkv = d.get("num_global_key_value_heads")
    if gkv is not None and gkv != kv_heads:
        problems.append(f"num_global_key_value_heads {gkv} differs from num_key_value_heads {kv_heads}: "
                        "per-layer KV head counts are not supported")

    layer_types = d.get("layer_types")
    if layer_types is None:
        # transformers' default: five sliding layers, then one full, repeated
        layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
    layer_types = _checked_layer_types(layer_types, layers, problems)
    if layer_types and layer_types[-1] != FULL:
        # transformers forces the last layer to full attention (with a warning); so do we, to
        # describe the model transformers actually runs.
        layer_types[-1] = FULL

    global_head_dim = _global_head_dim(d, layer_types, head_dim, problems)
    for name, v in (("head_dim", head_dim), ("global_head_dim", global_head_dim)):
        if v % 2:
            problems.append(f"{name} {v} must be even (RoPE rotates pairs)")

    if layers and not 0 <= shared < layers:
        problems.append(f"num_kv_shared_layers {shared} must lie in [0, num_hidden_layers)")
    elif layers:
        fs = layers - shared
        producers = set(layer_types[:fs])
        for t in sorted(set(layer_types[fs:]) - producers):
            problems.append(f"KV-shared layers of type '{t}' have no earlier layer of that type to read from")

    eps, cap = _eps_and_softcap(d, problems)
    dwm = d.get("use_double_wide_mlp", False)
    if not isinstance(dwm, bool):
        problems.append(f"use_double_wide_mlp must be true or false, got {dwm!r}")

    rope = _rope_parameters(d, layer_types, problems)
    if problems:
        raise ConversionError(f"{source}: unsupported or invalid Gemma 4 text config", problems)
    return TextConfig(
        hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        global_head_dim=global_head_dim, layer_types=tuple(layer_types), vocab_size=vocab,
        vocab_size_per_layer_input=ple_vocab, hidden_size_per_layer_input=ple,
        num_kv_shared_layers=shared, use_double_wide_mlp=dwm, rms_norm_eps=eps,
        final_logit_softcapping=cap, sliding_window=window, rope_parameters=rope,
    )


def _gemma3_rope(d: dict, layer_types: list[str], problems: list[str]) -> dict:
    """Per-type RoPE parameters of a Gemma 3 config: ``rope_parameters`` (transformers 5) as given, else the
    older top-level ``rope_theta`` (full layers), ``rope_local_base_freq`` (sliding layers) and
    ``rope_scaling`` (full layers only)."""
    if d.get("rope_parameters") is not None:
        return _rope_parameters(d, layer_types, problems)
    full = {"rope_type": "default", "rope_theta": d.get("rope_theta", _GEMMA3_DEFAULTS["rope_theta"])}
    scaling = d.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            problems.append("'rope_scaling' must be an object or null")
        else:
            full.update({k: v for k, v in scaling.items() if k != "type"})
            full["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    sliding = {"rope_type": "default",
               "rope_theta": d.get("rope_local_base_freq", _GEMMA3_DEFAULTS["rope_local_base_freq"])}
    return _rope_parameters({"rope_parameters": {FULL: full, SLIDING: sliding}}, layer_types, problems)


def _parse_gemma3(raw: dict, d: dict, source: str) -> TextConfig:
    """A Gemma 3 text config (transformers' Gemma3TextConfig, defaults included) as a TextConfig."""
    problems: list[str] = []
    for key in ("attention_bias", "use_bidirectional_attention"):
        if d.get(key):
            problems.append(f"{key} is true: not supported")
    if d.get("attn_logit_softcapping") is not None:
        problems.append("attn_logit_softcapping is set: attention-logit softcapping is not supported")

    hidden, layers, inter, heads, kv_heads, head_dim, vocab = _core_fields(raw, d, problems)
    window = _int(d, "sliding_window", problems, default=_GEMMA3_DEFAULTS["sliding_window"])
    pattern = _int(d, "sliding_window_pattern", problems, default=_GEMMA3_DEFAULTS["sliding_window_pattern"])
    _check_head_grouping(heads, kv_heads, problems)
    if head_dim % 2:
        problems.append(f"head_dim {head_dim} must be even (RoPE rotates pairs)")
    qpas = d.get("query_pre_attn_scalar", _GEMMA3_DEFAULTS["query_pre_attn_scalar"])
    if isinstance(qpas, bool) or not isinstance(qpas, (int, float)) or not qpas > 0:
        problems.append(f"query_pre_attn_scalar must be a positive number, got {qpas!r}")
        qpas = 1.0

    layer_types = d.get("layer_types")
    if layer_types is None and layers and pattern:
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    layer_types = _checked_layer_types(layer_types, layers, problems)

    eps, cap = _eps_and_softcap(d, problems)
    rope = _gemma3_rope(d, layer_types, problems)
    if problems:
        raise ConversionError(f"{source}: unsupported or invalid Gemma 3 text config", problems)
    return TextConfig(
        hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        global_head_dim=head_dim, layer_types=tuple(layer_types), vocab_size=vocab,
        vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=0,
        rms_norm_eps=eps, final_logit_softcapping=cap,
        sliding_window=window, rope_parameters=rope, architecture=GEMMA3, norm_offset=1.0,
        attention_scale=float(qpas) ** -0.5, use_v_norm=False, use_layer_scalar=False,
    )


def load_text_config(src: str | os.PathLike) -> TextConfig:
    """Read ``config.json`` from a checkpoint directory (or the directory of a .safetensors file,
    or the config file itself)."""
    p = Path(src)
    path = p if p.suffix == ".json" else (p.parent if p.is_file() else p) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{path}: not found (a Hugging Face checkpoint needs its config.json)") from None
    except OSError as e:
        raise ConversionError(f"{path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None
    return parse_text_config(raw, str(path))
