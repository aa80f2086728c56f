"""A float64 numpy forward pass of the Gemma 4 text decoder (gemma4-e2b-spec.md §3): the test oracle.

It takes Hugging Face-named weights (a checkpoint's, or values decoded from a .fgm) and the HF text config (a dict),
and returns the softcapped logits of every position. A Gemma 3 config (model_type gemma3_text) selects Gemma 3's
differences, as transformers' Gemma3ForCausalLM has them: attention scale query_pre_attn_scalar^-1/2, no v-norm, no
layer scalar, no per-layer inputs, no KV sharing, one head dim, norms multiplying by 1 + w, RoPE θ per layer type.
It is validated against transformers' own logits on every fixture (tests/test_reference.py, tests/test_gemma3.py),
and then serves as the oracle for configurations transformers was not run on.

Everything is float64; nothing is cached between calls (a greedy step recomputes the whole sequence), which is the
simplest correct semantics for an oracle and cheap at fixture sizes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

HF_PREFIX = "model.language_model."
_CAUSAL_LM_PREFIX = "model."  # a text-only Gemma4ForCausalLM checkpoint
LM_HEAD = "lm_head.weight"
_NON_TEXT = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_DEFAULT_ROPE = {  # transformers' Gemma4TextConfig defaults when a config has no rope_parameters
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text")


def text_config(config: dict) -> dict:
    """The decoder fields: `text_config` of a nested (released) config, or the dict itself if already flat."""
    return config["text_config"] if "text_config" in config else config


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint loading (a minimal safetensors reader, so tests need neither torch nor the converter's own reader)

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_safetensors(path) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file as float32 arrays (BF16 widened exactly)."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    hlen = int.from_bytes(data[:8], "little")
    if 8 + hlen > len(data):
        raise ValueError(f"{path}: header length {hlen} exceeds the file")
    header = json.loads(data[8 : 8 + hlen])
    body = memoryview(data)[8 + hlen :]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        arr = np.frombuffer(body[begin:end], dtype=_ST_DTYPES[entry["dtype"]])
        if arr.size != math.prod(shape):
            raise ValueError(f"{path}: tensor {name}: {arr.size} elements for shape {list(shape)}")
        if entry["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.astype(np.float32).reshape(shape)
    return out


def load_hf_checkpoint(path) -> tuple[dict, dict[str, np.ndarray]]:
    """(text config, weights) of a directory with config.json + model.safetensors.

    Weight names are normalised to the released checkpoint's `model.language_model.` prefix; tensors outside the
    text decoder (vision/audio towers) are dropped.
    """
    path = Path(path)
    cfg = text_config(json.loads((path / "config.json").read_text()))
    weights = {}
    for name, arr in read_safetensors(path / "model.safetensors").items():
        if name.startswith(HF_PREFIX) or name == LM_HEAD:
            weights[name] = arr
        elif name.startswith(_CAUSAL_LM_PREFIX) and not name.startswith(_NON_TEXT):
            weights[HF_PREFIX + name[len(_CAUSAL_LM_PREFIX) :]] = arr
    return cfg, weights


# ---------------------------------------------------------------------------------------------------------------
# Model structure derived from the config


class Structure:
    """Per-layer facts of a Gemma 4 (or Gemma 3) text config (validated; unsupported features raise ValueError)."""

    def __init__(self, config: dict):
        cfg = text_config(config)
        self.gemma3 = cfg.get("model_type", config.get("model_type")) in GEMMA3_MODEL_TYPES
        if self.gemma3:
            self._init_gemma3(cfg)
            return
        unsupported = (("enable_moe_block", True), ("attention_k_eq_v", True), ("use_bidirectional_attention", "all"))
        for key, bad in unsupported:
            if cfg.get(key) == bad:
                raise ValueError(f"unsupported Gemma 4 feature: {key}={bad!r}")
        if cfg.get("attention_bias"):
            raise ValueError("unsupported: attention_bias=true")
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {cfg['hidden_activation']!r}")
        if not cfg.get("hidden_size_per_layer_input"):
            raise ValueError("config has no per-layer inputs (hidden_size_per_layer_input); this oracle needs PLE")
        self.hidden = cfg["hidden_size"]
        self.n_layers = cfg["num_hidden_layers"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg["num_key_value_heads"]
        self.ple_dim = cfg["hidden_size_per_layer_input"]
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.softcap = cfg.get("final_logit_softcapping")
        self.window = cfg["sliding_window"]
        self.layer_types = list(cfg["layer_types"])
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        for t in set(self.layer_types):
            if t not in ("sliding_attention", "full_attention"):
                raise ValueError(f"unknown layer type {t!r}")
        if self.n_heads % self.n_kv:
            raise ValueError(f"{self.n_heads} query heads are not a multiple of {self.n_kv} KV heads")
        self.head_dims = [self._head_dim(cfg, i) for i in range(self.n_layers)]
        self.rope = cfg.get("rope_parameters") or _DEFAULT_ROPE
        self.attention_scale = 1.0  # Gemma 4: no 1/sqrt(d)
        self.norm_offset = 0.0      # Gemma 4 norms multiply by w
        self.v_norm = self.layer_scalar = True

        n_shared = cfg.get("num_kv_shared_layers") or 0
        self.first_shared = self.n_layers - n_shared
        # A shared layer reads the K/V of the last non-shared layer of its own type (HF kv_sharing_modes).
        self.kv_source = []
        for i, t in enumerate(self.layer_types):
            if i < self.first_shared:
                self.kv_source.append(i)
                continue
            producers = [j for j in range(self.first_shared) if self.layer_types[j] == t]
            if not producers:
                raise ValueError(f"shared layer {i} ({t}) has no earlier non-shared layer of its type")
            self.kv_source.append(producers[-1])

    def _init_gemma3(self, cfg: dict) -> None:
        for key in ("attention_bias", "use_bidirectional_attention"):
            if cfg.get(key):
                raise ValueError(f"unsupported Gemma 3 feature: {key}")
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("unsupported Gemma 3 feature: attn_logit_softcapping")
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {cfg['hidden_activation']!r}")
        self.hidden = cfg["hidden_size"]
        self.n_layers = cfg["num_hidden_layers"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg["num_key_value_heads"]
        self.ple_dim = 0
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.softcap = cfg.get("final_logit_softcapping")
        self.window = cfg.get("sliding_window", 4096)
        pattern = cfg.get("sliding_window_pattern", 6)
        self.layer_types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern
                                                           else "full_attention" for i in range(self.n_layers)])
        if self.n_heads % self.n_kv:
            raise ValueError(f"{self.n_heads} query heads are not a multiple of {self.n_kv} KV heads")
        self.head_dims = [cfg["head_dim"]] * self.n_layers
        rope = cfg.get("rope_parameters")
        if rope is None:  # the older top-level spelling
            full = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
            if cfg.get("rope_scaling"):
                scaling = dict(cfg["rope_scaling"])
                full["rope_type"] = scaling.pop("rope_type", scaling.pop("type", "default"))
                full.update(scaling)
            rope = {"full_attention": full,
                    "sliding_attention": {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}}
        self.rope = rope
        self.attention_scale = float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5
        self.norm_offset = 1.0  # Gemma3RMSNorm multiplies by 1 + w
        self.v_norm = self.layer_scalar = False
        self.first_shared = self.n_layers
        self.kv_source = list(range(self.n_layers))

    def _head_dim(self, cfg: dict, i: int) -> int:
        if self.layer_types[i] == "sliding_attention":
            return cfg["head_dim"]
        if cfg.get("global_head_dim"):
            return cfg["global_head_dim"]
        # transformers 5.23 re-serialises global_head_dim as per_layer_config {"04": {"head_dim": 512}, ...}
        for key, over in (cfg.get("per_layer_config") or {}).items():
            if int(key) == i and "head_dim" in over:
                return over["head_dim"]
        raise ValueError(f"full-attention layer {i}: config has neither global_head_dim nor per_layer_config")

    def inv_freq(self, layer_type: str, head_dim: int) -> np.ndarray:
        """RoPE inverse frequencies, length head_dim/2; non-rotated pairs get 0 (proportional RoPE)."""
        params = self.rope[layer_type]
        theta = params["rope_theta"]
        kind = params.get("rope_type", "default")
        if kind == "proportional":
            n_rot = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        elif kind in ("default", "linear"):  # linear: every frequency / factor (below)
            if params.get("partial_rotary_factor", 1.0) != 1.0:
                raise ValueError(f"{layer_type}: partial_rotary_factor with rope_type 'default' is not supported")
            n_rot = head_dim // 2
        else:
            raise ValueError(f"{layer_type}: unsupported rope_type {kind!r}")
        freq = np.zeros(head_dim // 2)
        freq[:n_rot] = theta ** (-np.arange(0, 2 * n_rot, 2, dtype=np.float64) / head_dim)
        return freq / params.get("factor", 1.0)


def live_weights(weights: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """The weights minus the dead k_proj/v_proj/k_norm of the KV-shared layers: the released checkpoint ships them,
    but nothing reads them (transformers ignores them, a converter drops them)."""
    s = Structure(config)
    dead = {f"{HF_PREFIX}layers.{i}.self_attn.{p}.weight" for i in range(s.first_shared, s.n_layers)
            for p in ("k_proj", "v_proj", "k_norm")}
    return {k: v for k, v in weights.items() if k not in dead}


# ---------------------------------------------------------------------------------------------------------------
# Forward pass


def _rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y  # w is the multiplier: Gemma 3's 1 + w comes with the offset added


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on x [T, heads, hd]: dims d and d + hd/2 form a pair."""
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [T, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class _Weights:
    def __init__(self, weights: dict[str, np.ndarray]):
        self.w = weights

    def __call__(self, name: str) -> np.ndarray:
        key = HF_PREFIX + name
        if key not in self.w:
            raise ValueError(f"missing weight {key}")
        return np.asarray(self.w[key], dtype=np.float64)

    def lm_head(self) -> np.ndarray:
        # A .fgm carries its own (differently quantised) LM head; a checkpoint ties it to the embedding.
        if LM_HEAD in self.w:
            return np.asarray(self.w[LM_HEAD], dtype=np.float64)
        return self("embed_tokens.weight")


def forward(weights: dict[str, np.ndarray], config: dict, token_ids, norms_as_stored: bool = False) -> np.ndarray:
    """Logits [T, V] (float64, after the final softcap) for every position of one sequence starting at position 0.

    norms_as_stored: the norm weights are already the multipliers (1 + w for Gemma 3, as a .fgm stores them, e.g.
    weights decoded by tools.fgm_decode) rather than a checkpoint's w."""
    s = Structure(config)
    W = _Weights(weights)
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    embed = W("embed_tokens.weight")
    ple_table = W("embed_tokens_per_layer.weight") if s.ple_dim else None
    rows = embed.shape[0] if ple_table is None else min(embed.shape[0], ple_table.shape[0])
    if ids.size == 0:
        raise ValueError("empty token sequence")
    if ids.min() < 0 or ids.max() >= rows:
        raise ValueError(f"token ids must lie in [0, {rows})")
    T, D, L, P = ids.size, s.hidden, s.n_layers, s.ple_dim
    if embed.shape[1] != D or (P and ple_table.shape[1] != L * P):
        raise ValueError(f"embedding shapes do not fit D={D}, L={L}, P={P}")
    pos = np.arange(T)
    offset = 0.0 if norms_as_stored else s.norm_offset

    def norm(name: str) -> np.ndarray:
        return W(name) + offset

    # Embedding and per-layer inputs (§3.1)
    h = embed[ids] * math.sqrt(D)
    if P:
        ple_tok = (ple_table[ids] * math.sqrt(P)).reshape(T, L, P)
        ple_ctx = (h @ W("per_layer_model_projection.weight").T) * D**-0.5
        ple_ctx = _rms_norm(ple_ctx.reshape(T, L, P), W("per_layer_projection_norm.weight"), s.eps)
        ple = (ple_ctx + ple_tok) * 2**-0.5

    causal = pos[None, :] <= pos[:, None]  # [query, key]
    sliding = causal & (pos[None, :] > pos[:, None] - s.window)  # the query sees itself + window-1 before it
    kv = {}
    for i in range(L):
        p = f"layers.{i}."
        t = s.layer_types[i]
        hd = s.head_dims[i]
        inv_freq = s.inv_freq(t, hd)

        # Attention block (§3.2)
        x = _rms_norm(h, norm(p + "input_layernorm.weight"), s.eps)
        q = (x @ W(p + "self_attn.q_proj.weight").T).reshape(T, s.n_heads, hd)
        q_norm = norm(p + "self_attn.q_norm.weight")
        if q_norm.shape != (hd,):
            raise ValueError(f"layer {i}: q_norm has shape {q_norm.shape} but the config's head_dim is {hd}")
        q = _rope(_rms_norm(q, q_norm, s.eps), pos, inv_freq)
        if s.kv_source[i] == i:
            k = (x @ W(p + "self_attn.k_proj.weight").T).reshape(T, s.n_kv, hd)
            v = (x @ W(p + "self_attn.v_proj.weight").T).reshape(T, s.n_kv, hd)
            k = _rope(_rms_norm(k, norm(p + "self_attn.k_norm.weight"), s.eps), pos, inv_freq)
            if s.v_norm:
                v = _rms_norm(v, None, s.eps)
            kv[i] = (k, v)
        k, v = kv[s.kv_source[i]]
        group = s.n_heads // s.n_kv
        kh = np.repeat(k, group, axis=1)  # query head j uses KV head j // group
        vh = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, kh) * s.attention_scale
        visible = sliding if t == "sliding_attention" else causal
        scores = np.where(visible[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", probs, vh).reshape(T, s.n_heads * hd)
        a = a @ W(p + "self_attn.o_proj.weight").T
        h = h + _rms_norm(a, norm(p + "post_attention_layernorm.weight"), s.eps)

        # MLP block
        x = _rms_norm(h, norm(p + "pre_feedforward_layernorm.weight"), s.eps)
        m = _gelu_tanh(x @ W(p + "mlp.gate_proj.weight").T) * (x @ W(p + "mlp.up_proj.weight").T)
        m = m @ W(p + "mlp.down_proj.weight").T
        h = h + _rms_norm(m, norm(p + "post_feedforward_layernorm.weight"), s.eps)

        if P:
            # Per-layer input block: the gate reads the residual stream itself, not a normed copy
            g = _gelu_tanh(h @ W(p + "per_layer_input_gate.weight").T) * ple[:, i, :]
            g = g @ W(p + "per_layer_projection.weight").T
            h = h + _rms_norm(g, W(p + "post_per_layer_input_norm.weight"), s.eps)

        if s.layer_scalar:
            h = h * W(p + "layer_scalar").reshape(())

    h = _rms_norm(h, norm("norm.weight"), s.eps)
    logits = h @ W.lm_head().T
    if s.softcap:
        logits = s.softcap * np.tanh(logits / s.softcap)
    return logits


def greedy(weights: dict[str, np.ndarray], config: dict, prompt_ids, n_steps: int,
           norms_as_stored: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Plain argmax continuation (no stop token): (ids [n_steps], the logits [n_steps, V] that chose each id)."""
    seq = list(np.asarray(prompt_ids).reshape(-1))
    ids, step_logits = [], []
    for _ in range(n_steps):
        last = forward(weights, config, seq, norms_as_stored)[-1]
        tok = int(np.argmax(last))
        ids.append(tok)
        step_logits.append(last)
        seq.append(tok)
    return np.asarray(ids, dtype=np.int64), np.stack(step_logits)


def max_rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref|: the tolerance measure used against transformers' logits."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"shape mismatch {got.shape} vs {ref.shape}")
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
