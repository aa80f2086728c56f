"""The engine's command-line tools: splitgemma generate, score and bench (splitgemma/commands/)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FASTGEMMA, fastgemma_fgm
from splitgemma.cli import main

TAME = FASTGEMMA["mini-e2b-tame"]
FGM = str(fastgemma_fgm("mini-e2b-tame"))
REF = np.load(TAME / "reference.npz")
PROMPT = [int(t) for t in REF["prompt_ids"][:12]]


def cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def generate_json(capsys, *argv):
    rc, out, err = cli(capsys, "generate", "--model", FGM, "--json", *argv)
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def engine():
    from splitgemma._native import Model
    return Model(FGM, max_context=4096)  # generate's defaults: context 4096, chunk 256


def engine_greedy(model, ids, n):
    """n greedy tokens, the engine driven directly (argmax of its logits, no stop tokens)."""
    from splitgemma.engine import open_arena
    arena = open_arena(model, 1)
    logits = model.prefill(arena, 0, ids)
    out = []
    for i in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.decode(arena, [0], [out[-1]], [len(ids) + i])[0]
    return out


def engine_sampled(model, ids, n, seed, **kw):
    from splitgemma.engine import open_arena, sample
    arena = open_arena(model, 1)
    logits = model.prefill(arena, 0, ids)
    out, state = [], seed
    for i in range(n):
        s = sample(logits, rng_state=state, **kw)
        out.append(s.token)
        state = s.rng_state
        logits = model.decode(arena, [0], [s.token], [len(ids) + i])[0]
    return out


# --------------------------------------------------------------------------------------------------- generate

def test_generate_greedy_equals_engine(capsys, engine):
    want = engine_greedy(engine, PROMPT, 24)
    got = generate_json(capsys, "--tokens", ",".join(map(str, PROMPT)), "--max-tokens", 24, "--ignore-eos")
    assert got["tokens"] == want
    assert got["finish_reason"] == "length"


def test_generate_json_shape(capsys):
    got = generate_json(capsys, "--tokens", ",".join(map(str, PROMPT)), "--max-tokens", 5, "--logprobs", 3,
                        "--ignore-eos")
    assert set(got) >= {"tokens", "text", "logprobs", "finish_reason", "timings", "prompt_tokens"}
    assert got["prompt_tokens"] == len(PROMPT) and len(got["tokens"]) == 5
    assert all(isinstance(t, int) for t in got["tokens"])
    # the tokenizer beside the model decodes the ids: its synthetic vocabulary names id i "w<i>"
    assert got["text"] == " ".join(f"w{t}" for t in got["tokens"])
    assert [lp["token"] for lp in got["logprobs"]] == got["tokens"]
    for lp in got["logprobs"]:
        assert lp["logprob"] <= 0 and len(lp["top_logprobs"]) == 3
        # greedy: the chosen token is the likeliest
        assert lp["top_logprobs"][0] == {"token": lp["token"], "logprob": lp["logprob"]}
    t = got["timings"]
    assert t["prefill_s"] > 0 and t["decode_steps"] == 4 and t["decode_tok_s"] > 0


def test_generate_sampling_is_seeded(capsys, engine):
    args = ("--tokens", ",".join(map(str, PROMPT)), "--max-tokens", 16, "--ignore-eos", "--temperature", "1.5",
            "--top-k", "50", "--top-p", "0.9")
    a = generate_json(capsys, *args, "--seed", 1234)
    b = generate_json(capsys, *args, "--seed", 1234)
    c = generate_json(capsys, *args, "--seed", 1235)
    assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
    assert a["tokens"] != c["tokens"]
    assert a["tokens"] == engine_sampled(engine, PROMPT, 16, 1234, temperature=1.5, top_k=50, top_p=0.9)
    assert a["tokens"] != engine_greedy(engine, PROMPT, 16)


def test_generate_tokens_from_npy(capsys, tmp_path):
    path = tmp_path / "ids.npy"
    np.save(path, np.array(PROMPT, dtype=np.int64))
    a = generate_json(capsys, "--tokens", path, "--max-tokens", 6)
    b = generate_json(capsys, "--tokens", ",".join(map(str, PROMPT)), "--max-tokens", 6)
    assert a["tokens"] == b["tokens"] and a["prompt_tokens"] == len(PROMPT)


def test_generate_prompt_with_fixture_tokenizer(capsys, engine):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(TAME / "tokenizer.json"))
    prompt = "w5 w17 w300 w42 w999 w8"
    ids = tok.encode(prompt).ids
    assert ids == [5, 17, 300, 42, 999, 8]
    want = engine_greedy(engine, ids, 10)
    got = generate_json(capsys, "--prompt", prompt, "--max-tokens", 10, "--ignore-eos")
    assert got["tokens"] == want and got["prompt_tokens"] == 6
    assert got["text"] == tok.decode(want)
    # plain mode streams the same text, then a newline; the summary goes to stderr
    rc, out, err = cli(capsys, "generate", "--model", FGM, "--prompt", prompt, "--max-tokens", 10, "--ignore-eos")
    assert rc == 0 and out == got["text"] + "\n" and "finish: length" in err


def test_generate_stops_at_stop_token(capsys, tmp_path, engine):
    """The stop tokens come from the config beside the model: name a later greedy token as eos."""
    prompt = [int(t) for t in REF["prompt_ids"]]  # chosen (README) for its many distinct greedy tokens
    want = engine_greedy(engine, prompt, 8)
    j = next(i for i in range(1, 8) if want[i] not in want[:i])  # the first new token after the first
    stop = want[j]
    model = tmp_path / "m.fgm"
    shutil.copy(FGM, model)
    shutil.copy(TAME / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [stop, 1]}))
    ids = ",".join(map(str, prompt))
    rc, out, err = cli(capsys, "generate", "--model", model, "--tokens", ids, "--max-tokens", 8, "--json")
    got = json.loads(out)
    assert got["tokens"] == want[:j + 1] and got["finish_reason"] == "stop" and got["stop_token"] == stop
    assert got["text"] == " ".join(f"w{t}" for t in want[:j])  # the stop token's text is not emitted
    got = json.loads(cli(capsys, "generate", "--model", model, "--tokens", ids, "--max-tokens", 8, "--json",
                         "--ignore-eos")[1])
    assert got["tokens"] == want and got["finish_reason"] == "length"


def test_generate_stops_at_the_context(capsys, engine):
    got = generate_json(capsys, "--tokens", ",".join(map(str, PROMPT)), "--max-tokens", 50, "--ignore-eos",
                        "--max-context", len(PROMPT) + 3)
    # positions len..len+2 are written by feeding tokens back; the 4th token needs no position of its own
    assert got["finish_reason"] == "context" and len(got["tokens"]) == 4
    assert got["tokens"] == engine_greedy(engine, PROMPT, 4)


def test_generate_without_tokenizer(capsys, tmp_path):
    model = tmp_path / "alone.fgm"
    shutil.copy(FGM, model)
    rc, out, err = cli(capsys, "generate", "--model", model, "--tokens", "2,5,9", "--max-tokens", 3, "--ignore-eos")
    assert rc == 0 and len(out.split()) == 3 and all(t.isdigit() for t in out.split())  # ids, streamed
    rc, out, err = cli(capsys, "generate", "--model", model, "--prompt", "w5", "--max-tokens", 3)
    assert rc == 1 and "no tokenizer found" in err and "--tokenizer" in err
    rc, out, err = cli(capsys, "generate", "--model", model, "--prompt", "w5 w6", "--max-tokens", 2, "--tokenizer",
                       TAME / "tokenizer.json", "--ignore-eos", "--json")
    assert rc == 0 and json.loads(out)["prompt_tokens"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model.fgm", "--tokens", "1,2"], "cannot open"),
    (["--model", FGM, "--tokens", "1,x,3"], "'x' is not an integer token id"),
    (["--model", FGM, "--tokens", "1,,3"], "is not an integer token id"),
    (["--model", FGM, "--tokens", "5,1024"], "token id 1024 at index 1 is outside the vocabulary [0, 1024)"),
    (["--model", FGM, "--tokens", "-3"], "token id -3 at index 0 is outside the vocabulary"),
    (["--model", FGM, "--tokens", "99999999999999999999999"], "outside the vocabulary"),
    (["--model", FGM, "--tokens", "/nonexistent/ids.npy"], "cannot read token ids"),
    (["--model", FGM, "--tokens", ",".join(["7"] * 20), "--max-context", "16"],
     "the prompt has 20 tokens, more than the context of 16"),
    (["--model", FGM, "--tokens", "1,2", "--temperature", "-1"], "--temperature must be"),
    (["--model", FGM, "--tokens", "1,2", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--model", FGM, "--tokens", "1,2", "--logprobs", "2000"], "--logprobs must be in [0, 1024]"),
    (["--model", FGM, "--tokens", "1,2", "--weights", "int5"], "weights policy"),
])
def test_generate_errors(capsys, argv, message):
    rc, out, err = cli(capsys, "generate", "--max-tokens", 4, *argv)
    assert rc == 1 and out == ""
    assert err.startswith("splitgemma: error: ") and message in err


def test_generate_npy_of_floats_refused(capsys, tmp_path):
    path = tmp_path / "f.npy"
    np.save(path, np.array([1.0, 2.0]))
    rc, _, err = cli(capsys, "generate", "--model", FGM, "--tokens", path, "--max-tokens", 2)
    assert rc == 1 and "expected a 1-D integer array" in err


def test_errors_from_the_command_line_have_no_traceback(tmp_path):
    for argv in (["generate", "--model", str(tmp_path / "missing.fgm"), "--tokens", "1", "--max-tokens", "1"],
                 ["generate", "--model", FGM, "--tokens", "4096", "--max-tokens", "1"]):
        p = subprocess.run([sys.executable, "-m", "splitgemma", *argv], capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and "Traceback" not in p.stderr and "splitgemma: error:" in p.stderr, p.stderr


# --------------------------------------------------------------------------------------------------- score

@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_score_matches_reference(capsys, tmp_path, monkeypatch, report, weights):
    """Logits of every prompt position against transformers run on the weights decoded from the .fgm."""
    ids = tmp_path / "ids.npy"
    np.save(ids, REF["prompt_ids"])
    out = tmp_path / "logits.npy"
    monkeypatch.setenv("FGM_WEIGHTS", weights)
    rc, stdout, err = cli(capsys, "score", "--model", FGM, "--tokens", ids, "--out", out)
    assert rc == 0, err
    got = np.load(out)
    want = REF[f"fgm_{weights}_logits"]
    assert got.dtype == np.float32 and got.shape == want.shape == (40, 1024)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    report(f"score mini-e2b-tame {weights}: cosine min {cos.min():.5f} mean {cos.mean():.5f}, argmax agreement "
           f"{(got.argmax(1) == want.argmax(1)).mean():.3f}")
    assert cos.min() >= 0.995


def test_score_equals_engine_and_keeps_the_file_name(capsys, tmp_path):
    from splitgemma.engine import open_arena
    out = tmp_path / "scores.bin"  # not .npy: the name is kept as given
    rc, _, err = cli(capsys, "score", "--model", FGM, "--tokens", ",".join(map(str, PROMPT)), "--out", out,
                     "--weights", "int8")
    assert rc == 0, err
    from splitgemma._native import Model
    m = Model(FGM, max_context=len(PROMPT), weights="int8")
    want = m.prefill(open_arena(m, 1), 0, PROMPT, all_logits=True)
    np.testing.assert_array_equal(np.load(out), want)
    rc, _, err = cli(capsys, "score", "--model", FGM, "--tokens", "3,1024", "--out", out)
    assert rc == 1 and "outside the vocabulary" in err


# --------------------------------------------------------------------------------------------------- bench

def test_bench_json_shape(capsys):
    rc, out, err = cli(capsys, "bench", "--model", FGM, "--prompt-lens", "24,48", "--batches", "1,3",
                       "--context", 20, "--steps", 3, "--repeats", 2, "--threads", 2, "--decode-prefix", "both",
                       "--ignore-load", "--json")
    assert rc == 0, err
    r = json.loads(out)
    backend = r["backend"]
    assert backend in ("amx", "vnni", "avx2") and r["threads"] == 2
    assert r["weights"]["decode"] == "int4"  # what the decode worker serves
    assert set(r["limits"]) == {f"{backend}_int8_tops", "dram_read_gbs"}
    assert all(v > 0 for v in r["limits"].values())
    # the peak is the best of the readings taken before and after the figures; the bandwidth the median of the
    # passes over a buffer no smaller than the largest decode step's weight bytes, the same number before and after
    from splitgemma.commands.bench import DRAM_PASSES
    assert [len(v) for v in r["limit_readings"].values()] == [6, 2 * DRAM_PASSES, 2 * DRAM_PASSES]
    assert r["limits"][f"{backend}_int8_tops"] == max(r["limit_readings"]["peak_tops"])
    assert r["limits"]["dram_read_gbs"] == statistics.median(r["limit_readings"]["dram_gbs"])
    probe = r["dram_probe"]
    assert probe["passes"] == 2 * DRAM_PASSES
    assert probe["range_gbs"] == [min(r["limit_readings"]["dram_gbs"]), max(r["limit_readings"]["dram_gbs"])]
    assert probe["bytes"] >= max(d["weight_bytes_per_step"] for d in r["decode"])
    # the same probe over the model file's own mapped pages, all of them: what decode streams
    assert r["file_probe"]["bytes"] == os.path.getsize(FGM)
    assert r["file_probe"]["read_gbs"] == statistics.median(r["limit_readings"]["file_gbs"]) > 0
    # and how much of it the page cache holds in 2 MB pages (found in smaps: an int, not None)
    assert 0 <= r["file_probe"]["pmd_mapped_bytes"] <= r["file_probe"]["bytes"]
    # pages reading well below fresh memory (a VM's page cache refilled from the block device) get a note
    from splitgemma.commands.bench import render
    slow = json.loads(out)
    slow["file_probe"]["read_gbs"] = slow["limits"]["dram_read_gbs"] / 2
    assert "the model file's pages read at 50% of fresh memory" in render(slow)
    slow["file_probe"]["pmd_mapped_bytes"] = slow["file_probe"]["bytes"] // 4
    assert "; 25% of them in 2 MB pages)" in render(slow)
    assert [p["prompt_len"] for p in r["prefill"]] == [24, 48]
    # a batch with the context in every slot, then read from one prefix slot; a single sequence has no one to share
    # it with
    assert [(d["batch"], d["context"], d["shared_prefix"]) for d in r["decode"]] == \
        [(1, 20, False), (3, 20, False), (3, 20, True)]
    for row in r["prefill"] + r["decode"]:
        assert row["tok_s_min"] <= row["tok_s"] <= row["tok_s_max"] and len(row["seconds"]) == 2
    assert all(0 < p["ratio_to_peak"] and p["gemm_macs"] > 0 for p in r["prefill"])
    assert all(0 < d["ratio_to_dram"] and d["weight_bytes_per_step"] > 0 for d in r["decode"])
    for d in r["decode"]:  # each repeat against the probe passes just before and after it
        br = d["dram_brackets_gbs"]
        assert len(br) == 3 and all(g > 0 for g in br)
        per_repeat = [d["weight_bytes_per_step"] * 3 / t / 1e9 / ((lo + hi) / 2)
                      for t, lo, hi in zip(d["seconds"], br, br[1:])]
        assert d["ratio_to_dram"] == pytest.approx(statistics.median(per_repeat))
    assert {"start", "max", "limit"} <= set(r["load"])
    assert all(row["load_1min"] >= 0 for row in r["prefill"] + r["decode"])


def test_bench_text_and_rising_load_warning(capsys, monkeypatch):
    """Started quiet, the load then rises past the limit (raised by the benchmark's own thread while it runs):
    one warning when it first does, another when it has risen by half again; the table names the load after each
    figure."""
    import os
    run_limit = 0.5 * os.cpu_count() + 1  # --threads 1
    loads = iter([0.1, 0.1, run_limit + 0.2, run_limit + 0.3, 1.5 * (run_limit + 0.2) + 0.1])
    last = [0.0]

    def fake_loadavg():
        last[0] = next(loads, last[0])
        return (last[0], 0.0, 0.0)

    monkeypatch.setattr(os, "getloadavg", fake_loadavg)
    rc, out, err = cli(capsys, "bench", "--model", FGM, "--prompt-lens", "16", "--batches", "1,2", "--context", 8,
                       "--steps", 2, "--repeats", 1, "--threads", 1)
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    # loads read: start, probes (quiet), prefill 16 (over), decode 1 (over, not half again), decode 2 (half again)
    assert len(warnings) == 2 and "during prefill 16" in warnings[0] and "during decode batch 2" in warnings[1]
    assert "prefill 16" in out and "decode B=2 @8 shared" in out and "of peak" in out and "of DRAM" in out


def test_bench_refuses_a_loaded_machine(capsys, monkeypatch):
    import os
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count()), 1.0, 1.0))
    rc, out, err = cli(capsys, "bench", "--model", FGM, "--prompt-lens", "8", "--batches", "1", "--json")
    assert rc == 1 and out == "" and "load average" in err and "--ignore-load" in err


def test_bench_rejects_a_bad_decode_weight_policy(capsys):
    rc, out, err = cli(capsys, "bench", "--model", FGM, "--prompt-lens", "8", "--batches", "1", "--ignore-load",
                       "--decode-weights", "int5")
    assert rc != 0 and out == "" and "--decode-weights" in err and "int4, int8 or auto:M" in err


def test_bench_work_model():
    """GEMM multiply-adds and decode bytes from the tensor table: one token runs every linear on one row; each
    further token adds the same cost (the layers before the first KV-shared one); decode bytes follow the weight
    policy's choice of copy."""
    from splitgemma._native import FgmFile
    from splitgemma.commands.bench import _linears, decode_step_bytes, prefill_macs
    f = FgmFile(FGM)
    cfg = json.loads(f.header_json)["config"]
    lin = _linears(f, "int8")
    all_nk = sum(f.tensor_info(n)["shape"][0] * f.tensor_info(n)["shape"][1] for n in f.tensor_names
                 if f.tensor_info(n)["dtype"] in ("q8c", "q4g") and not n.endswith(".i8"))
    assert prefill_macs(lin, cfg, 1) == all_nk
    step = prefill_macs(lin, cfg, 2) - prefill_macs(lin, cfg, 1)
    assert prefill_macs(lin, cfg, 10) == all_nk + 9 * step
    assert 0 < step < all_nk  # the shortcut skips layers 4 and 5, the LM head and their projection rows
    int4 = decode_step_bytes(lin, "int4", 8, 8)
    int8 = decode_step_bytes(lin, "int8", 8, 8)
    assert int4 < int8
    assert decode_step_bytes(lin, "auto:16", 8, 8) == int4 and decode_step_bytes(lin, "auto:16", 16, 16) == int8
    assert decode_step_bytes(lin, "int4", 8, 4) == 2 * int4  # two passes
    i8 = sum(f.tensor_info(n)["nbytes"] for n in f.tensor_names if n.endswith(".i8") or n.endswith(".i8.scale"))
    q4 = sum(f.tensor_info(n[: -len(".i8")])["nbytes"] + f.tensor_info(n[: -len(".i8")] + ".scale")["nbytes"]
             for n in f.tensor_names if n.endswith(".i8"))
    assert int8 - int4 == i8 - q4


@pytest.mark.parametrize("group", [32, 8])
def test_bench_counts_weight_only_gemms_apart(tmp_path, group):
    """With f32 activations a q8g (int8g) file runs its GEMMs as f32 FMAs: none of its multiply-adds count against
    the int8 peak, all of them in the f32 figure. With int8 activations those whose group and K fit the int8 kernel's
    units (group 32 here, not 8) count as int8 multiply-adds, the others still as f32. Its decode bytes are the q8g
    codes and f32 scales either way. Its embedding table is the tied LM head (there is no lm_head tensor): counted
    once, as the head."""
    from splitgemma._native import FgmFile, kernels
    from splitgemma.commands.bench import _linears, decode_step_bytes, prefill_macs
    from splitgemma.fgm import convert_checkpoint
    out = tmp_path / "tiny-int8g.fgm"
    convert_checkpoint(Path(__file__).parent / "fixtures" / "gemma3-tiny", out, weights="int8g", group=group,
                       progress=False)
    f = FgmFile(str(out))
    cfg = json.loads(f.header_json)["config"]
    q8g = [n for n in f.tensor_names if f.tensor_info(n)["dtype"] == "q8g"]
    assert "lm_head" not in f.tensor_names and "embed_tokens" in q8g
    nk = sum(f.tensor_info(n)["shape"][0] * f.tensor_info(n)["shape"][1] for n in q8g)
    lin = _linears(f, "f32")
    assert sorted(w["name"] for w in lin) == sorted(["lm_head" if n == "embed_tokens" else n for n in q8g])
    assert all(w["f32"] for w in lin)
    assert prefill_macs(lin, cfg, 7) == 0
    assert prefill_macs(lin, cfg, 1, f32=True) == nk
    lin8 = _linears(f, "int8")
    assert [w["f32"] for w in lin8] == [not kernels.q8g_runs_int8(w["k"], group) for w in lin8]
    assert any(not w["f32"] for w in lin8) == (group == 32)
    assert prefill_macs(lin8, cfg, 1) + prefill_macs(lin8, cfg, 1, f32=True) == nk
    assert decode_step_bytes(lin, "auto:16", 1, 8) == sum(f.tensor_info(n)["nbytes"] +
                                                          f.tensor_info(n + ".scale")["nbytes"] for n in q8g)
