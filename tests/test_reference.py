"""The float64 numpy reference forward pass (tests/tools/reference_forward.py) against transformers' fp32 logits.

On fastgemma's checkpoints it also runs on weights decoded from fastgemma's own .fgm, which validates the numpy
decoder (tests/tools/fgm_decode.py) against a converter we did not write; on our fixtures it runs on weights decoded
from the project converter's .fgm (checked against the digest recorded when the references were made).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import FASTGEMMA, OURS, fastgemma_fgm

from tools.fgm_decode import FgmReader
from tools.reference_forward import Structure, forward, greedy, load_hf_checkpoint, max_rel_err

TOL = 1e-4  # max|d| / max|ref|: transformers runs in fp32, the oracle in float64


def check_run(report, label, weights, cfg, prompt, logits, greedy_ids, step_logits):
    """Prompt logits, and teacher-forced greedy steps: one forward over prompt + greedy[:-1] gives every step's
    logits (a no-cache greedy step is exactly that prefix's last position)."""
    err = max_rel_err(forward(weights, cfg, prompt), logits)
    seq = np.concatenate([prompt, greedy_ids[:-1]])
    steps = forward(weights, cfg, seq)[len(prompt) - 1 :]
    err_steps = max_rel_err(steps, step_logits)
    report(f"reference vs transformers  {label:34s} prompt {err:.2e}  greedy steps {err_steps:.2e}")
    assert err <= TOL, f"{label}: prompt logits differ from transformers by {err:.3g} (relative)"
    assert err_steps <= TOL, f"{label}: greedy-step logits differ from transformers by {err_steps:.3g} (relative)"
    assert np.array_equal(steps.argmax(axis=-1), greedy_ids), f"{label}: greedy path differs"


@pytest.mark.parametrize("name", sorted(FASTGEMMA))
def test_fastgemma_checkpoint_and_its_fgm(name, report):
    cfg, weights = load_hf_checkpoint(FASTGEMMA[name])
    ref = np.load(FASTGEMMA[name] / "reference.npz")
    prompt = ref["prompt_ids"]
    check_run(report, f"{name} checkpoint", weights, cfg, prompt, ref["logits"], ref["greedy_ids"],
              ref["greedy_step_logits"])
    reader = FgmReader(fastgemma_fgm(name))
    for ffn in ("int4", "int8"):
        p = f"fgm_{ffn}_"
        check_run(report, f"{name} fastgemma .fgm {ffn}", reader.hf_weights(ffn=ffn), cfg, prompt,
                  ref[p + "logits"], ref[p + "greedy_ids"], ref[p + "greedy_step_logits"])


@pytest.mark.parametrize("name", sorted(OURS))
def test_our_fixture_checkpoint(name, report):
    cfg, weights = load_hf_checkpoint(OURS[name])
    ref = np.load(OURS[name] / "reference.npz")
    for j in range(len(ref["prompt_lengths"])):
        check_run(report, f"{name} checkpoint prompt {j}", weights, cfg, ref[f"prompt_ids_{j}"], ref[f"logits_{j}"],
                  ref[f"greedy_ids_{j}"], ref[f"greedy_step_logits_{j}"])


@pytest.mark.parametrize("name", sorted(OURS))
def test_our_fixture_fgm(name, converted_fgm, report):
    cfg, _ = load_hf_checkpoint(OURS[name])
    ref = np.load(OURS[name] / "reference.npz")
    reader = FgmReader(converted_fgm(name))
    for ffn in ("int4", "int8"):
        weights = reader.hf_weights(ffn=ffn)
        p = f"fgm_{ffn}_"
        for j in range(len(ref["prompt_lengths"])):
            check_run(report, f"{name} .fgm {ffn} prompt {j}", weights, cfg, ref[f"prompt_ids_{j}"],
                      ref[f"{p}logits_{j}"], ref[f"{p}greedy_ids_{j}"], ref[f"{p}greedy_step_logits_{j}"])


def test_greedy_helper_reproduces_transformers_generation():
    cfg, weights = load_hf_checkpoint(OURS["g4-e2b"])
    ref = np.load(OURS["g4-e2b"] / "reference.npz")
    ids, step_logits = greedy(weights, cfg, ref["prompt_ids_0"], len(ref["greedy_ids_0"]))
    assert np.array_equal(ids, ref["greedy_ids_0"])
    assert max_rel_err(step_logits, ref["greedy_step_logits_0"]) <= TOL


def test_config_spellings_agree():
    """transformers re-serialises global_head_dim as per_layer_config; both spellings (and a nested config) give the
    same model."""
    cfg, weights = load_hf_checkpoint(OURS["g4-e2b"])
    prompt = np.load(OURS["g4-e2b"] / "reference.npz")["prompt_ids_0"]
    base = forward(weights, cfg, prompt)
    per_layer = copy.deepcopy(cfg)
    ghd = per_layer.pop("global_head_dim")
    per_layer["per_layer_config"] = {f"{i:02d}": {"head_dim": ghd} for i, t in enumerate(cfg["layer_types"])
                                     if t == "full_attention"}
    assert np.array_equal(forward(weights, per_layer, prompt), base)
    assert np.array_equal(forward(weights, {"text_config": cfg}, prompt), base)


def test_structure_follows_kv_sharing_rule():
    """Shared layers read the last non-shared layer of their own type (transformers' kv_sharing_modes)."""
    cfg, _ = load_hf_checkpoint(OURS["g4-e4b"])  # s,s,s,F,s | s,s,F shared
    assert Structure(cfg).kv_source == [0, 1, 2, 3, 4, 4, 4, 3]
    cfg, _ = load_hf_checkpoint(OURS["g4-e2b"])  # s,s,F | s,s,F shared
    assert Structure(cfg).kv_source == [0, 1, 2, 1, 1, 2]


def test_bad_input_is_rejected_precisely():
    cfg, weights = load_hf_checkpoint(OURS["g4-e2b"])
    with pytest.raises(ValueError, match="token ids must lie in"):
        forward(weights, cfg, [2, cfg["vocab_size"]])
    with pytest.raises(ValueError, match="empty token sequence"):
        forward(weights, cfg, [])
    bad = dict(cfg, enable_moe_block=True)
    with pytest.raises(ValueError, match="enable_moe_block"):
        forward(weights, bad, [2])
    bad = dict(cfg, global_head_dim=None)
    with pytest.raises(ValueError, match="neither global_head_dim nor per_layer_config"):
        forward(weights, bad, [2])
    bad = dict(cfg, num_kv_shared_layers=5)  # only layer 0 (sliding) computes K/V: full layers have no producer
    with pytest.raises(ValueError, match="no earlier non-shared layer"):
        forward(weights, bad, [2])
    missing = {k: v for k, v in weights.items() if not k.endswith("layers.0.mlp.up_proj.weight")}
    with pytest.raises(ValueError, match="missing weight .*layers.0.mlp.up_proj.weight"):
        forward(missing, cfg, [2])
