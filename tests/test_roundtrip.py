"""Checkpoint -> .fgm -> numpy decode: every tensor equals the Hugging Face weight within the error its class allows.

The .fgm files are the project converter's (of every fixture checkpoint; of ours also with --weights int8g) and
fastgemma's own (of its two checkpoints); decoding is tests/tools/fgm_decode.py, which was written from the format
descriptions only. The measured relative Frobenius error per class is reported in the terminal summary with -v.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from conftest import ALL_CHECKPOINTS, FASTGEMMA, FASTGEMMA_GROUP, OURS, fastgemma_fgm

from tools.fgm_decode import LM_HEAD, Q4R_GROUP, FgmReader, hf_name, rotate_k
from tools.reference_forward import HF_PREFIX, Structure, live_weights, load_hf_checkpoint

CASES = [("ours", name) for name in ALL_CHECKPOINTS] + [("fastgemma", name) for name in FASTGEMMA]
INT4_REL_ERR = 0.12  # int4 with one scale per 64..256 weights: ~0.09-0.10 on Gaussian weights


def role(name: str) -> str:
    base = name.removesuffix(".i8")
    suffix = base.rsplit(".", 1)[-1]
    roles = {"lm_head": "lm_head", "embed_tokens": "embed table", "embed_tokens_per_layer": "PLE table",
             "per_layer_model_projection": "PLE model proj", "q_proj": "attn", "k_proj": "attn", "v_proj": "attn",
             "o_proj": "attn", "gate_proj": "ffn", "up_proj": "ffn", "down_proj": "ffn",
             "per_layer_input_gate": "PLE layer proj", "per_layer_projection": "PLE layer proj"}
    r = roles.get(suffix, "norms/scalars")
    return r + " .i8 twin" if name.endswith(".i8") else r


def int4_bound(target: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """Per-element bound for round-to-nearest int4 codes in [-8, 7] with scale s per group of `group` along K:
    |s|/2, except that the group's extreme may be clipped (|error| <= amax - 7|s|); plus 1% of |s| for the f16
    rounding of a scale chosen in float32. Holds for any sign convention of s."""
    n, k = target.shape
    t = target.reshape(n, k // group, group)
    amax = np.abs(t).max(axis=-1, keepdims=True)
    s = np.abs(scale)[:, :, None]
    return np.broadcast_to(np.maximum(0.5 * s, amax - 7 * s) + 0.01 * s, t.shape).reshape(n, k)


def check_tensor(reader: FgmReader, name: str, w: np.ndarray, group: int) -> None:
    info = reader.info(name)
    dtype, shape = info["dtype"], tuple(info["shape"])
    assert shape == w.shape, f"{name}: shape {shape}, checkpoint {w.shape}"
    if dtype in ("f32", "f16"):
        assert np.array_equal(reader.dequantize(name), w), f"{name}: {dtype} tensor is not an exact copy"
        return
    k = shape[1]
    if dtype in ("q8c", "q4g"):
        assert info["hadamard"] == (128 if k % 128 == 0 else 0), f"{name}: hadamard {info['hadamard']} for K={k}"
    else:
        assert info["hadamard"] == 0, f"{name}: gather tables and q8g weights are never rotated"
    target = rotate_k(w, info["hadamard"]) if info["hadamard"] else w  # quantisation happens in the rotated domain
    codes, scales = reader.codes_and_scales(name)
    deq = reader.dequantize(name)
    err = np.abs(deq - target)
    if dtype in ("q8c", "q8r"):
        assert codes.min() >= -127 and codes.max() <= 127, f"{name}: int8 code -128 present"
        bound = 0.501 * np.abs(scales.astype(np.float64))[:, None]
    elif dtype == "q8g":
        assert codes.min() >= -127 and codes.max() <= 127, f"{name}: int8 code -128 present"
        assert info["group"] == group, f"{name}: group {info['group']}, converted with {group}"
        # half a step of the group's scale: amax/254 when rounded, ~0 when the values were already on a grid
        bound = np.repeat(0.501 * np.abs(scales.astype(np.float64)).T, group, axis=1)
    elif dtype == "q4g":
        assert info["group"] == group, f"{name}: group {info['group']}, converted with {group}"
        bound = int4_bound(target, scales.astype(np.float64).T, group)
    else:  # q4r
        bound = int4_bound(target, scales.astype(np.float64), Q4R_GROUP)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"{name} ({dtype}): error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    if dtype in ("q4g", "q4r"):
        rel = np.linalg.norm(deq - target) / np.linalg.norm(target)
        assert rel <= INT4_REL_ERR, f"{name}: int4 relative error {rel:.3f}"


@pytest.mark.parametrize("source,name", CASES, ids=[f"{s}-fgm-of-{n}" for s, n in CASES])
def test_roundtrip(source, name, converted_fgm, report):
    if source == "ours":
        path = converted_fgm(name)
        group = int(np.load(ALL_CHECKPOINTS[name] / "reference.npz")["fgm_group"]) if name in OURS else FASTGEMMA_GROUP
    else:
        path, group = fastgemma_fgm(name), FASTGEMMA_GROUP
    check_file(FgmReader(path), name, group, f"{source}-fgm-of-{name}", report)


@pytest.mark.parametrize("name", sorted(OURS))
def test_roundtrip_int8g(name, tmp_path, report):
    """--weights int8g: every linear and the embedding q8g (group 32, unrotated, no twins; the embedding table is
    also the tied LM head, so there is no lm_head tensor), the PLE table still q4r."""
    from splitgemma.fgm.convert import convert_checkpoint

    path = tmp_path / f"{name}-int8g.fgm"
    convert_checkpoint(ALL_CHECKPOINTS[name], path, weights="int8g", progress=False)
    reader = FgmReader(path)
    check_file(reader, name, 32, f"ours-int8g-of-{name}", report)
    for n in reader.names:
        dtype = reader.info(n)["dtype"]
        if n == "embed_tokens_per_layer":
            assert dtype == "q4r"
        elif hf_name(n) is not None and len(reader.info(n)["shape"]) == 2:
            assert dtype == "q8g", f"{n}: {dtype}"
        assert not n.endswith(".i8"), n


def check_file(reader: FgmReader, name: str, group: int, label: str, report) -> None:
    cfg, weights = load_hf_checkpoint(ALL_CHECKPOINTS[name])
    live = live_weights(weights, cfg)

    # Inventory: every live tensor once (the embedding twice: gather table + LM head, except where one q8g table is
    # both), FFN int8 twins present.
    decoded = {hf_name(n) for n in reader.names} - {None}
    tied = reader.info("embed_tokens")["dtype"] == "q8g"
    assert decoded == set(live) | (set() if tied else {LM_HEAD})
    for n in reader.names:
        if n.endswith(("gate_proj", "up_proj", "down_proj")) and reader.info(n)["dtype"] == "q4g":
            assert n + ".i8" in reader.file, f"{n}: dual conversion but no .i8 twin"

    # Values, with per-class error statistics in the checkpoint's basis (un-rotated: the rotation is orthogonal,
    # so the relative Frobenius error is the same as in the rotated domain).
    sq_err, sq_ref, worst = defaultdict(float), defaultdict(float), defaultdict(float)
    for n in reader.names:
        hf = hf_name(n)
        if hf is None:
            continue
        w = live[HF_PREFIX + "embed_tokens.weight" if hf == LM_HEAD else hf].astype(np.float64)
        check_tensor(reader, n, w, group)
        key = f"{reader.info(n)['dtype']} {role(n)}"
        d = np.linalg.norm(reader.weight(n) - w) ** 2
        sq_err[key] += d
        sq_ref[key] += np.linalg.norm(w) ** 2
        worst[key] = max(worst[key], np.sqrt(d / np.linalg.norm(w) ** 2))
    for key in sorted(sq_err):
        report(f"roundtrip {label:30s} {key:26s} rel Frobenius {np.sqrt(sq_err[key] / sq_ref[key]):.5f}"
               f"  (worst tensor {worst[key]:.5f})")

    # RoPE tables and the config an engine routes K/V by.
    s = Structure(cfg)
    tables = reader.rope_inv_freq()
    assert set(tables) == set(s.layer_types)
    for t, table in tables.items():
        want = s.inv_freq(t, s.head_dims[s.layer_types.index(t)])
        assert table.shape == want.shape and np.allclose(table, want, rtol=1e-6, atol=0), f"rope.{t}.inv_freq"
    assert reader.config["first_shared_layer"] == s.first_shared
    assert reader.config["store_full_length_kv"] == sorted({s.kv_source[i] for i in range(s.first_shared, s.n_layers)})


def _direct_code(raw: np.ndarray, dtype: str, n: int, k: int, N: int, K: int) -> int:
    """One code read by the byte-address formulas of fgm-format.md §3.2/3.3/3.5 (a scalar re-statement of what the
    decoder does with array reshapes)."""
    if dtype in ("q8c", "q4g"):
        a = ((n // 16) * (K // 64) + k // 64) * 1024 + ((k % 64) // 4) * 64 + (n % 16) * 4 + k % 4
        if dtype == "q8c":
            return int(raw[a].astype(np.int8))
        byte, high = (a // 64) * 32 + a % 32, (a % 64) >= 32
    else:  # q4r
        j = k % 64
        byte, high = n * (K // 2) + (k // 64) * 32 + j % 32, j >= 32
    v = (int(raw[byte]) >> 4) if high else (int(raw[byte]) & 15)
    return v - 16 if v >= 8 else v


@pytest.mark.parametrize("fgm", ["fastgemma-mini-e2b", "ours-g4-e4b"])
def test_decoder_matches_byte_addressing(fgm, converted_fgm):
    path = fastgemma_fgm("mini-e2b") if fgm.startswith("fastgemma") else converted_fgm("g4-e4b")
    reader = FgmReader(path)
    rng = np.random.default_rng(7)
    names = [n for n in reader.names if reader.info(n)["dtype"] in ("q8c", "q4g", "q4r")
             and (n.startswith("l0.") or "." not in n)]
    assert {reader.info(n)["dtype"] for n in names} == {"q8c", "q4g", "q4r"}
    for name in names:
        N, K = reader.info(name)["shape"]
        codes, _ = reader.codes_and_scales(name)
        raw = reader.file.raw(name)
        for n, k in zip(rng.integers(0, N, 300), rng.integers(0, K, 300)):
            assert codes[n, k] == _direct_code(raw, reader.info(name)["dtype"], n, k, N, K), (name, n, k)
