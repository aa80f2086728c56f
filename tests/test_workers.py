"""The prefill and decode workers as real processes (python -m splitgemma prefill/decode) driven through the gRPC
contract: the handoff through the shared-memory arena against the in-process engine, continuous batching, leases
(expiry, release, cancellation, stale or forged generations, another layout), stop handling, and what happens when
a worker is SIGKILLed or stopped with SIGTERM. Every call has a timeout, so a bug fails rather than hangs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tokenizers import Tokenizer, decoders, models

from splitgemma.engine import KvArena, Model, open_arena, sample
from splitgemma.serving.detokenize import TextStream
from splitgemma.serving.shm_arena import PREFIX, SlotLocks, open_shared_arena, request_key
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pb_grpc
from tools.procs import (SPLITGEMMA, LoggedProcess, free_ports, grpc_serving, private_shm, shm_folder,
                         terminate, wait_decode_idle, wait_until)

FIXTURE = Path(__file__).parent / "fixtures" / "fastgemma" / "mini-e2b-tame"
FGM = FIXTURE / "mini-e2b-tame.fgm"
CTX, CHUNK = 256, 32  # small chunks, so prompts of a few dozen tokens run in several passes
RPC_TIMEOUT = 20


# ---------------------------------------------------------------------------------------------------------------
# TextStream (no processes)


def _byte_fallback_tokenizer() -> tuple[Tokenizer, dict]:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tok, vocab


def test_text_stream_never_splits_a_utf8_character():
    tok, vocab = _byte_fallback_tokenizer()
    ids = tok.encode("a€b😀").ids  # € and 😀 are 3 and 4 byte-fallback tokens
    assert len(ids) == 1 + 3 + 1 + 4
    ts = TextStream(tok)
    pieces = [ts.push(i)[0] for i in ids]
    assert pieces == ["a", "", "", "€", "b", "", "", "", "😀"]
    assert "".join(pieces) == tok.decode(ids)


def test_text_stream_survives_bytes_that_never_form_a_character():
    """A lead byte followed by a plain token can never complete its character: it comes out as U+FFFD with the
    token after it (tokenizers' DecodeStream raised "Invalid prefix" here, which ended the stream), and an
    incomplete character at the very end comes out at flush()."""
    tok, vocab = _byte_fallback_tokenizer()
    ts = TextStream(tok)
    assert [ts.push(vocab[t])[0] for t in ("<0x41>", "<0xC3>", "a", "b")] == ["A", "", "\ufffda", "b"]
    assert ts.flush() == ""
    ts = TextStream(tok)
    assert [ts.push(vocab[t])[0] for t in ("a", "<0xE2>", "<0x82>")] == ["a", "", ""]
    assert ts.flush() == "\ufffd\ufffd"  # as tokenizer.decode gives the two bytes of an unfinished "€"
    assert "a" + "\ufffd\ufffd" == tok.decode([vocab[t] for t in ("a", "<0xE2>", "<0x82>")])


def test_text_stream_stop_strings():
    tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))  # word level: "w4".."w1023", joined by spaces
    ids = [10, 11, 12, 13, 14]
    full = tok.decode(ids)
    assert full == "w10 w11 w12 w13 w14"
    # A stop string across two pieces: everything from the match on is dropped, the text before is released.
    ts = TextStream(tok, ["1 w12"])
    out = [ts.push(i) for i in ids[:3]]
    assert out == [("w10", None), (" w1", None), ("", "1 w12")]  # "1" held back: it may start the stop string
    ts = TextStream(tok, ["1 w12"])
    got, matched = "", None
    for i in ids:
        piece, matched = ts.push(i)
        got += piece
        if matched:
            break
    assert matched == "1 w12" and got == full[: full.find("1 w12")]
    # Text that might start a stop string is held back, then released when it cannot; flush() gives the rest.
    ts = TextStream(tok, [" w12x", "w14!"])
    pieces = [ts.push(i) for i in ids]
    assert all(m is None for _, m in pieces)
    assert pieces[2][0] == "" and pieces[3][0] == " w12 w13"  # " w12" held until " w13" rules " w12x" out
    assert "".join(p for p, _ in pieces) + ts.flush() == full
    # The earliest match wins; at the same position the longer stop string.
    ts = TextStream(tok, ["w11", "w1", "w12"])
    assert ts.push(10) == ("", "w1")
    ts = TextStream(tok, ["w1", "w10"])
    assert ts.push(10) == ("", "w10")


# ---------------------------------------------------------------------------------------------------------------
# Processes


class Worker:
    def __init__(self, kind: str, args: list[str], log: Path):
        self.kind = kind
        (self.port,) = free_ports(1)
        self.proc = LoggedProcess([*SPLITGEMMA, kind, "--port", str(self.port), "--threads", "1", *args], log)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def wait_ready(self, timeout: float = 60) -> "Worker":
        wait_until(lambda: grpc_serving(self.channel), f"{self.kind} worker", timeout, watch={self.kind: self.proc},
                   interval=0.05)
        return self

    def log_text(self) -> str:
        return self.proc.log()

    def stop(self) -> None:
        terminate([self.proc], 15)
        self.channel.close()


@pytest.fixture(scope="module")
def shm_dir():
    """For the module's worker pair (replaces conftest's per-test folder)."""
    with private_shm("workers") as d:
        yield str(d)


@pytest.fixture(scope="module")
def pair(shm_dir, tmp_path_factory):
    """A decode worker (8 slots, tokenizer found beside the model, metrics on) and a prefill worker."""
    logs = tmp_path_factory.mktemp("logs")
    metrics = dict(zip(("decode", "prefill"), free_ports(2)))
    geometry = ["--model", str(FGM), "--max-context", str(CTX), "--chunk", str(CHUNK), "--shm-dir", shm_dir]
    d = Worker("decode", [*geometry, "--slots", "8", "--max-batch", "8", "--metrics-port", str(metrics["decode"])],
               logs / "decode.log")
    p = Worker("prefill", [*geometry, "--metrics-port", str(metrics["prefill"])], logs / "prefill.log")
    try:
        d.wait_ready()
        p.wait_ready()
        yield Client(d, p, metrics)
    finally:
        d.stop()
        p.stop()


@pytest.fixture(scope="module")
def ref_model():
    return Model(str(FGM), threads=1, max_context=CTX, chunk=CHUNK, max_batch=8, weights="auto:16")


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))


def greedy() -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, logprobs=True)


def seeded(seed: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=kw.get("temperature", 1.0), top_k=kw.get("top_k", 0),
                             top_p=kw.get("top_p", 1.0), seed=seed, logprobs=True, top_logprobs=kw.get("top", 0))


def reference(model: Model, prompt, n: int, p: pb.SamplingParams, stop_ids=()) -> list:
    """The in-process engine: one prefill, then decode one token at a time, same sampling rules."""
    kw = {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p or 1.0, "n_logprobs": p.top_logprobs}
    arena = open_arena(model, 1)
    out = [sample(model.prefill(arena, 0, prompt), rng_state=p.seed, **kw)]
    while len(out) < n and out[-1].token not in stop_ids:
        logits = model.decode(arena, [0], [out[-1].token], [len(prompt) + len(out) - 1])[0]
        out.append(sample(logits, rng_state=out[-1].rng_state, **kw))
    return out


class Client:
    def __init__(self, decode: Worker, prefill: Worker, metrics_ports: dict | None = None):
        self.decode_worker, self.prefill_worker = decode, prefill
        self.decode = pb_grpc.DecodeStub(decode.channel)
        self.prefill = pb_grpc.PrefillStub(prefill.channel)
        self.metrics_ports = metrics_ports

    def reserve(self, rid: str, n_prompt: int, max_tokens: int = 0, lease_ms: int = 0) -> pb.Lease:
        return self.decode.Reserve(pb.ReserveRequest(request_id=rid, prompt_tokens=n_prompt, max_tokens=max_tokens,
                                                     lease_ms=lease_ms), timeout=RPC_TIMEOUT)

    def prefill_req(self, rid: str, prompt, lease: pb.Lease, sampling: pb.SamplingParams) -> pb.PrefillRequest:
        return pb.PrefillRequest(request_id=rid, prompt_token_ids=list(map(int, prompt)), lease=lease,
                                 sampling=sampling)

    def gen_req(self, rid, lease, n_prompt, pre: pb.PrefillResponse, sampling, max_tokens, **kw):
        return pb.GenerateRequest(request_id=rid, lease=lease, prompt_tokens=n_prompt, first_token=pre.first_token,
                                  sampling=sampling, max_tokens=max_tokens, rng_state=pre.rng_state, **kw)

    def run(self, rid: str, prompt, max_tokens: int, sampling: pb.SamplingParams, **kw):
        """Reserve → Prefill → Generate; returns (lease, prefill response, events)."""
        lease = self.reserve(rid, len(prompt), max_tokens)
        pre = self.prefill.Prefill(self.prefill_req(rid, prompt, lease, sampling), timeout=RPC_TIMEOUT)
        events = list(self.decode.Generate(self.gen_req(rid, lease, len(prompt), pre, sampling, max_tokens, **kw),
                                           timeout=RPC_TIMEOUT))
        return lease, pre, events

    def stats(self) -> pb.DecodeStats:
        return self.decode.Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT)

    def wait_idle(self, timeout: float = 5) -> pb.DecodeStats:
        """Stats once no slot is leased, running or quarantined (fails after `timeout`)."""
        return wait_decode_idle(self.stats, timeout)


def tokens_of(events) -> list:
    return [t for ev in events for t in ev.tokens]


def prompt_of(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, 1024, n)


def status_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


# ---------------------------------------------------------------------------------------------------------------
# The handoff and the decode loop


def test_health_and_reflection(pair):
    for w, service in ((pair.decode_worker, "splitgemma.v1.Decode"), (pair.prefill_worker, "splitgemma.v1.Prefill")):
        h = health_pb2_grpc.HealthStub(w.channel)
        for name in ("", service):
            assert h.Check(health_pb2.HealthCheckRequest(service=name), timeout=RPC_TIMEOUT).status == \
                health_pb2.HealthCheckResponse.SERVING
        r = reflection_pb2_grpc.ServerReflectionStub(w.channel)
        resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                           timeout=RPC_TIMEOUT))
        names = {s.name for s in resp.list_services_response.service}
        assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_greedy_equals_in_process_engine(pair, ref_model, tokenizer, shm_dir):
    prompt = prompt_of(1, 70)  # three prefill passes of 32, 32 and 6 rows
    rid = "greedy-1"
    lease = pair.reserve(rid, len(prompt), 24)
    assert lease.layout_signature == ref_model.layout_signature and lease.slot_bytes == ref_model.kv_slot_bytes
    assert (lease.max_context, lease.chunk, lease.n_slots) == (CTX, CHUNK, 8)
    assert abs(lease.deadline_unix_ms / 1000 - (time.time() + 30)) < 5  # the default --lease-ms
    req = pair.prefill_req(rid, prompt, lease, greedy())
    pre = pair.prefill.Prefill(req, timeout=RPC_TIMEOUT)
    assert pre.prompt_tokens == 70
    # No K/V on the wire: the request is token ids and a lease.
    assert pre.kv_bytes_written > 30_000 and len(req.SerializeToString()) * 50 < pre.kv_bytes_written

    # The slot header, read through our own mapping of the decode worker's file, is the prefill worker's seal.
    view = open_shared_arena(ref_model, lease.arena_path, lease.n_slots, lease.slot_bytes, shm_dir)
    h = view.arena.header(lease.slot)
    assert h["valid"] and h["sealed"] and h["n_tokens"] == 70
    assert (h["request_id"], h["generation"], h["checksum"]) == (request_key(rid), lease.generation, pre.kv_checksum)
    view.arena.verify(lease.slot, request_key(rid), lease.generation)
    del view

    events = list(pair.decode.Generate(pair.gen_req(rid, lease, 70, pre, greedy(), 24, ignore_eos=True),
                                       timeout=RPC_TIMEOUT))
    ref = reference(ref_model, prompt, 24, greedy())
    got = tokens_of(events)
    assert [t.token_id for t in got] == [s.token for s in ref]
    assert np.allclose([t.logprob for t in got], [s.logprob for s in ref], atol=1e-4)
    assert events[-1].finish_reason == pb.FINISH_REASON_LENGTH and events[-1].completion_tokens == 24
    assert all(not ev.finish_reason for ev in events[:-1])
    assert "".join(t.text for t in got) == tokenizer.decode([s.token for s in ref])
    pair.wait_idle()


def test_seeded_sampling_with_logprobs_equals_engine(pair, ref_model):
    prompt = prompt_of(2, 40)
    p = seeded(1234, temperature=0.9, top_k=40, top_p=0.95, top=3)
    _, pre, events = pair.run("seeded-1", prompt, 30, p, ignore_eos=True)
    ref = reference(ref_model, prompt, 30, p)
    got = tokens_of(events)
    assert [t.token_id for t in got] == [s.token for s in ref]
    assert len(set(t.token_id for t in got)) > 5  # really sampled
    assert pre.first_token.token_id == ref[0].token and pre.rng_state == ref[0].rng_state
    for t, s in zip(got, ref):
        assert [x.token_id for x in t.top_logprobs] == [i for i, _ in s.top_logprobs]
        assert np.allclose([x.logprob for x in t.top_logprobs], [lp for _, lp in s.top_logprobs], atol=1e-4)


def test_model_stop_tokens(pair, ref_model):
    # Without ignore_eos the model's own stop tokens (config.json beside the model: 1 and 106) end the stream.
    for seed in range(5):
        prompt = prompt_of(10 + seed, 20)
        p = seeded(seed, temperature=1.5)
        ref = reference(ref_model, prompt, 60, p, stop_ids={1, 106})
        _, _, events = pair.run(f"eos-{seed}", prompt, 60, p)
        assert [t.token_id for t in tokens_of(events)] == [s.token for s in ref]
        if ref[-1].token in (1, 106):
            assert events[-1].finish_reason == pb.FINISH_REASON_STOP
            assert events[-1].stop_token_id == ref[-1].token and events[-1].stop_reason in ("<eos>", "w106")
            assert events[-1].tokens[-1].text == ""
        else:
            assert events[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_stop_strings_and_stop_token_ids(pair, ref_model, tokenizer):
    prompt = prompt_of(3, 30)
    p = seeded(99, temperature=1.0)
    ref = [s.token for s in reference(ref_model, prompt, 40, p)]
    full = tokenizer.decode(ref)

    # A stop string: the text up to the match, the tokens up to the one completing it, nothing after.
    stop = " " + tokenizer.decode(ref[6:8])
    cut = full.find(stop)
    n = next(k for k in range(1, len(ref) + 1) if len(tokenizer.decode(ref[:k])) >= cut + len(stop))
    _, _, events = pair.run("stop-str", prompt, 40, p, stop=["never-there", stop], ignore_eos=True)
    got = tokens_of(events)
    assert [t.token_id for t in got] == ref[:n]
    assert "".join(t.text for t in got) == full[:cut]
    assert events[-1].finish_reason == pb.FINISH_REASON_STOP and events[-1].stop_reason == stop
    assert not events[-1].HasField("stop_token_id")

    # A stop string that only starts to match: held back, then released; the full text arrives.
    _, _, events = pair.run("stop-partial", prompt, 40, p, stop=[" " + tokenizer.decode(ref[5:6]) + " zz"],
                            ignore_eos=True)
    assert "".join(t.text for t in tokens_of(events)) == full
    assert events[-1].finish_reason == pb.FINISH_REASON_LENGTH

    # An extra stop token id: the stream ends with that token (sent, its text not).
    k = ref.index(ref[9])
    _, _, events = pair.run("stop-id", prompt, 40, p, stop_token_ids=[ref[9]], ignore_eos=True)
    got = tokens_of(events)
    assert [t.token_id for t in got] == ref[:k + 1] and got[-1].text == ""
    assert "".join(t.text for t in got) == tokenizer.decode(ref[:k])
    assert events[-1].finish_reason == pb.FINISH_REASON_STOP and events[-1].stop_token_id == ref[9]
    assert events[-1].completion_tokens == k + 1
    pair.wait_idle()


def test_context_limit(pair, ref_model):
    # A prompt of CTX - 3 tokens leaves room to feed 3 tokens back: the 4th generated token is the last.
    prompt = prompt_of(4, CTX - 3)
    _, _, events = pair.run("ctx", prompt, 0, greedy(), ignore_eos=True)
    ref = reference(ref_model, prompt, 4, greedy())
    assert [t.token_id for t in tokens_of(events)] == [s.token for s in ref]
    assert events[-1].finish_reason == pb.FINISH_REASON_LENGTH
    code, msg = status_of(lambda: pair.reserve("too-long", CTX - 3, 4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the slot context" in msg


def test_concurrent_streams_share_decode_steps(pair, ref_model):
    n, length = 8, 48
    prompts = [prompt_of(100 + i, 20 + 7 * i) for i in range(n)]
    params = [greedy() if i % 2 else seeded(i, temperature=0.8, top_k=50) for i in range(n)]
    before = pair.stats()
    results: dict[int, object] = {}

    def one(i: int) -> None:
        try:
            results[i] = pair.run(f"conc-{i}", prompts[i], length, params[i], ignore_eos=True)[2]
        except Exception as e:  # reported by the main thread
            results[i] = e

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    wall = time.perf_counter() - t0
    after = pair.stats()
    for i in range(n):
        assert not isinstance(results[i], Exception), results[i]
        ref = reference(ref_model, prompts[i], length, params[i])
        assert [t.token_id for t in tokens_of(results[i])] == [s.token for s in ref], f"stream {i}"
    assert after.max_batch_seen > 1
    assert max(ev.batch_size for i in range(n) for ev in results[i]) > 1
    assert after.tokens_generated - before.tokens_generated == n * (length - 1)  # the first tokens are prefill's
    print(f"\n8 streams x {length} tokens: {after.steps - before.steps} steps in {wall:.2f} s wall, "
          f"max batch {after.max_batch_seen}")
    pair.wait_idle()


def test_unclaimed_lease_expires(pair):
    before = pair.stats()
    lease = pair.reserve("expire-1", 8, lease_ms=150)
    assert pair.stats().slots_leased == 1
    time.sleep(0.3)
    st = pair.stats()
    assert st.leases_expired == before.leases_expired + 1 and st.slots_leased == 0
    # Past its deadline the lease is refused by both workers.
    code, msg = status_of(lambda: pair.prefill.Prefill(pair.prefill_req("expire-1", prompt_of(7, 8), lease,
                                                                        greedy()), timeout=RPC_TIMEOUT))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "expired" in msg
    fake = pb.PrefillResponse(first_token=pb.Token(token_id=5))
    code, _ = status_of(lambda: list(pair.decode.Generate(pair.gen_req("expire-1", lease, 8, fake, greedy(), 4),
                                                          timeout=RPC_TIMEOUT)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    pair.wait_idle()  # no prefill held the slot: it is free again at once


def test_a_slot_still_written_is_not_handed_out(pair, shm_dir, ref_model):
    """The writer protocol (shm_arena.SlotLocks): while a prefill holds a released slot's writer lock — here this
    test holds it, as a prefill stalled mid-chunk would — the decode worker keeps the slot quarantined and leases only
    the others; once the lock is let go the slot comes back with its lease stamp cleared, and a prefill of the
    released lease is then refused without writing a byte."""
    lease = pair.reserve("stale-1", 8)
    view = open_shared_arena(ref_model, lease.arena_path, lease.n_slots, lease.slot_bytes, shm_dir)
    assert view.arena.header(lease.slot)["generation"] == lease.generation  # stamped by the decode worker
    assert view.locks.try_lock(lease.slot)
    try:
        assert pair.decode.Release(pb.ReleaseRequest(request_id="stale-1", lease=lease), timeout=RPC_TIMEOUT).released
        time.sleep(0.2)  # several sweeps
        assert pair.stats().slots_quarantined == 1
        others = [pair.reserve(f"stale-other-{i}", 8) for i in range(7)]
        assert lease.slot not in {o.slot for o in others}
        # No slot left: a Reserve waits in the queue; its caller's deadline takes it out again.
        code, _ = status_of(lambda: pair.decode.Reserve(pb.ReserveRequest(request_id="stale-none",
                                                                          prompt_tokens=8), timeout=0.5))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: pair.stats().admission.queued == 0, "the queue to empty", RPC_TIMEOUT)
        assert pair.stats().slots_quarantined == 1
        for i, o in enumerate(others):
            pair.decode.Release(pb.ReleaseRequest(request_id=f"stale-other-{i}", lease=o), timeout=RPC_TIMEOUT)
    finally:
        view.locks.unlock(lease.slot)
    pair.wait_idle()
    assert view.arena.header(lease.slot)["generation"] == 0  # revoked under the lock
    start = lease.slot * lease.slot_bytes
    before = bytes(view.buf[start:start + lease.slot_bytes])
    code, msg = status_of(lambda: pair.prefill.Prefill(pair.prefill_req("stale-1", prompt_of(9, 40), lease, greedy()),
                                                       timeout=RPC_TIMEOUT))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "revoked" in msg and "nothing was written" in msg
    assert bytes(view.buf[start:start + lease.slot_bytes]) == before


def test_a_killed_writer_does_not_pin_its_slot(pair, shm_dir, tmp_path):
    """The kernel drops a dead holder's writer lock: a slot released while its (killed) writer held the lock comes
    back as soon as the process is gone."""
    lease = pair.reserve("killed-1", 8)
    ready = tmp_path / "locked"
    code = textwrap.dedent(f"""
        import os, time
        from splitgemma.engine import Model
        from splitgemma.serving.shm_arena import open_shared_arena
        m = Model({str(FGM)!r}, threads=1, max_context={CTX}, chunk={CHUNK})
        view = open_shared_arena(m, {lease.arena_path!r}, {lease.n_slots}, {lease.slot_bytes}, {shm_dir!r})
        assert view.locks.try_lock({lease.slot})
        open({str(ready)!r}, "w").close()
        time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_until(ready.exists, "the lock holder to take the slot lock", 30)
        assert pair.decode.Release(pb.ReleaseRequest(request_id="killed-1", lease=lease), timeout=RPC_TIMEOUT).released
        time.sleep(0.2)
        assert pair.stats().slots_quarantined == 1
    finally:
        holder.kill()
        holder.wait(10)
    pair.wait_idle()


def test_release_before_generate(pair):
    lease = pair.reserve("rel-2", 8)
    req = pb.ReleaseRequest(request_id="rel-2", lease=lease)
    assert pair.decode.Release(req, timeout=RPC_TIMEOUT).released
    assert not pair.decode.Release(req, timeout=RPC_TIMEOUT).released  # idempotent
    pair.wait_idle()


def test_stale_or_forged_generation_is_refused(pair, shm_dir, ref_model):
    prompt = prompt_of(8, 24)
    before = pair.stats()
    # The prefill worker refuses a lease whose generation is not the slot's lease stamp, before writing anything.
    lease = pair.reserve("forge-1", 24)
    forged = pb.Lease()
    forged.CopyFrom(lease)
    forged.generation += 1
    code, msg = status_of(lambda: pair.prefill.Prefill(pair.prefill_req("forge-1", prompt, forged, greedy()),
                                                       timeout=RPC_TIMEOUT))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not leased to generation" in msg
    # A writer that ignores the protocol and seals under another generation: the decode worker's check of the
    # header refuses the slot all the same.
    view = open_shared_arena(ref_model, lease.arena_path, lease.n_slots, lease.slot_bytes, shm_dir)
    last = ref_model.prefill(view.arena, lease.slot, prompt)
    view.arena.seal(lease.slot, request_key("forge-1"), forged.generation)
    pre = pb.PrefillResponse(first_token=pb.Token(token_id=int(np.argmax(last))))
    code, msg = status_of(lambda: list(pair.decode.Generate(pair.gen_req("forge-1", lease, 24, pre, greedy(), 4),
                                                            timeout=RPC_TIMEOUT)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "stale lease" in msg
    # A Generate presenting a forged generation for a live lease is refused and leaves the lease alone.
    lease = pair.reserve("forge-2", 24)
    pre = pair.prefill.Prefill(pair.prefill_req("forge-2", prompt, lease, greedy()), timeout=RPC_TIMEOUT)
    forged.CopyFrom(lease)
    forged.generation += 7
    code, msg = status_of(lambda: list(pair.decode.Generate(pair.gen_req("forge-2", forged, 24, pre, greedy(), 4),
                                                            timeout=RPC_TIMEOUT)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "stale or forged" in msg
    # ... and so is another request id on it (the header names its request).
    code, _ = status_of(lambda: list(pair.decode.Generate(pair.gen_req("forge-x", lease, 24, pre, greedy(), 4),
                                                          timeout=RPC_TIMEOUT)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    events = list(pair.decode.Generate(pair.gen_req("forge-2", lease, 24, pre, greedy(), 4), timeout=RPC_TIMEOUT))
    assert events[-1].completion_tokens == 4
    # A lease nobody issued, and one for another worker.
    forged.slot = (lease.slot + 1) % lease.n_slots
    code, _ = status_of(lambda: list(pair.decode.Generate(pair.gen_req("forge-2", forged, 24, pre, greedy(), 4),
                                                          timeout=RPC_TIMEOUT)))
    assert code == grpc.StatusCode.NOT_FOUND
    forged.worker_id = "someone-else"
    code, _ = status_of(lambda: list(pair.decode.Generate(pair.gen_req("forge-2", forged, 24, pre, greedy(), 4),
                                                          timeout=RPC_TIMEOUT)))
    assert code == grpc.StatusCode.NOT_FOUND
    assert pair.stats().admissions_refused == before.admissions_refused + 3
    pair.wait_idle()


def test_other_layout_is_refused(pair, shm_dir):
    prompt = prompt_of(9, 20)
    lease = pair.reserve("layout-1", 20)
    # The prefill worker checks the lease against its own model.
    for field, value, words in (("layout_signature", lease.layout_signature ^ 1, "layout signature"),
                                ("max_context", CTX * 2, "same --max-context and --chunk")):
        other = pb.Lease()
        other.CopyFrom(lease)
        setattr(other, field, value)
        code, msg = status_of(lambda: pair.prefill.Prefill(pair.prefill_req("layout-1", prompt, other, greedy()),
                                                           timeout=RPC_TIMEOUT))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in msg
    # A header written by a model with another slot geometry (max_context 128) into the leased slot, sealed for
    # exactly this lease: the decode worker refuses it.
    m128 = Model(str(FGM), threads=1, max_context=128, chunk=CHUNK, max_batch=1)
    view = open_shared_arena(Model(str(FGM), threads=1, max_context=CTX, chunk=CHUNK, max_batch=1),
                             lease.arena_path, lease.n_slots, lease.slot_bytes, shm_dir)
    off = lease.slot * lease.slot_bytes
    small = KvArena(m128, memoryview(view.buf)[off:off + m128.kv_slot_bytes], 1)
    last = m128.prefill(small, 0, prompt)
    small.seal(0, request_key("layout-1"), lease.generation)
    first = sample(last, temperature=0)
    fake = pb.PrefillResponse(first_token=pb.Token(token_id=first.token))
    code, msg = status_of(lambda: list(pair.decode.Generate(pair.gen_req("layout-1", lease, 20, fake, greedy(), 4),
                                                            timeout=RPC_TIMEOUT)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "different slot geometry" in msg
    del small, view
    pair.wait_idle()


def test_bad_requests(pair):
    lease = pair.reserve("bad-1", 4)
    for prompt, sampling, words in (([5, 6, 5000, 7], greedy(), "outside the vocabulary"),
                                    ([], greedy(), "empty"),
                                    ([5, 6, 7, 8], pb.SamplingParams(temperature=-1), "temperature"),
                                    ([5, 6, 7, 8], pb.SamplingParams(top_logprobs=21), "top_logprobs")):
        code, msg = status_of(lambda: pair.prefill.Prefill(pair.prefill_req("bad-1", prompt, lease, sampling),
                                                           timeout=RPC_TIMEOUT))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in msg, msg
    code, msg = status_of(lambda: pair.reserve("bad-2", 0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # A Generate with bad parameters is refused and gives its slot back.
    pre = pair.prefill.Prefill(pair.prefill_req("bad-1", [5, 6, 7, 8], lease, greedy()), timeout=RPC_TIMEOUT)
    code, msg = status_of(lambda: list(pair.decode.Generate(
        pair.gen_req("bad-1", lease, 4, pre, pb.SamplingParams(top_p=2), 4), timeout=RPC_TIMEOUT)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in msg
    pair.wait_idle()


def test_slots_run_out(pair):
    """With every slot leased, a Reserve waits in the queue and gets the first slot given back."""
    leases = [pair.reserve(f"full-{i}", 4) for i in range(8)]
    assert len({lease.slot for lease in leases}) == 8
    before = pair.stats().admission
    waiting = pair.decode.Reserve.future(pb.ReserveRequest(request_id="full-9", prompt_tokens=4),
                                         timeout=RPC_TIMEOUT)
    wait_until(lambda: pair.stats().admission.queued == 1, "the Reserve to queue", RPC_TIMEOUT)
    assert not waiting.done()
    assert pair.decode.Release(pb.ReleaseRequest(request_id="full-3", lease=leases[3]), timeout=RPC_TIMEOUT).released
    granted = waiting.result(RPC_TIMEOUT)
    assert granted.slot == leases[3].slot and granted.generation != leases[3].generation
    st = pair.stats().admission
    assert st.queued == 0 and st.queued_total == before.queued_total + 1
    leases[3] = granted
    for i, lease in enumerate(leases):
        rid = "full-9" if i == 3 else f"full-{i}"
        assert pair.decode.Release(pb.ReleaseRequest(request_id=rid, lease=lease), timeout=RPC_TIMEOUT).released
    pair.wait_idle()


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=RPC_TIMEOUT).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            values[name] = float(v)
    return values


def test_metrics_endpoints(pair):
    pair.run("metrics-1", prompt_of(30, 40), 8, greedy(), ignore_eos=True)
    lease = pair.reserve("metrics-2", 4, lease_ms=1)
    with pytest.raises(grpc.RpcError):  # out of the vocabulary
        pair.prefill.Prefill(pair.prefill_req("metrics-2", [5, 5000], lease, greedy()), timeout=RPC_TIMEOUT)
    time.sleep(0.01)
    with pytest.raises(grpc.RpcError):  # expired
        pair.prefill.Prefill(pair.prefill_req("metrics-2", [5, 6], lease, greedy()), timeout=RPC_TIMEOUT)
    values = _metrics(pair.metrics_ports["prefill"])
    assert values['splitgemma_prefill_requests_total{outcome="ok"}'] >= 1
    assert values['splitgemma_prefill_requests_total{outcome="invalid_argument"}'] >= 1
    assert values['splitgemma_prefill_requests_total{outcome="deadline_exceeded"}'] >= 1
    assert values["splitgemma_prefill_tokens_total"] >= 40
    pair.wait_idle()
    seal = values["splitgemma_prefill_handoff_seal_seconds_sum"] / values["splitgemma_prefill_handoff_seal_seconds_count"]
    values = _metrics(pair.metrics_ports["decode"])
    assert values["splitgemma_decode_handoff_verify_seconds_count"] >= 1
    assert values["splitgemma_decode_tokens_total"] >= 7
    assert values['splitgemma_decode_requests_total{outcome="length"}'] >= 1
    assert values["splitgemma_decode_step_seconds_count"] >= 1
    assert values['splitgemma_decode_slots{state="free"}'] == 8
    verify = values["splitgemma_decode_handoff_verify_seconds_sum"] / values["splitgemma_decode_handoff_verify_seconds_count"]
    step = values["splitgemma_decode_step_seconds_sum"] / values["splitgemma_decode_step_seconds_count"]
    print(f"\nmean handoff seal {seal * 1e6:.0f} us, verify {verify * 1e6:.0f} us; mean decode step "
          f"{step * 1e3:.2f} ms")


# ---------------------------------------------------------------------------------------------------------------
# Long slots: calls that last long enough to be cancelled, released or broken in the middle


LONG_CTX = 4096


@pytest.fixture(scope="module")
def long_dir():
    with private_shm("long") as d:
        yield str(d)


@pytest.fixture(scope="module")
def long_pair(long_dir, tmp_path_factory):
    """Workers with 4096-position slots; the decode worker's model file has no tokenizer or config beside it."""
    logs = tmp_path_factory.mktemp("long")
    (logs / "bare").mkdir()
    (logs / "bare" / "model.fgm").symlink_to(FGM)
    geometry = ["--max-context", str(LONG_CTX), "--chunk", "256", "--shm-dir", long_dir]
    d = Worker("decode", ["--model", str(logs / "bare" / "model.fgm"), *geometry, "--slots", "4",
                          "--lease-ms", "20000"], logs / "decode.log")
    p = Worker("prefill", ["--model", str(FGM), *geometry], logs / "prefill.log")
    try:
        d.wait_ready()
        p.wait_ready()
        yield Client(d, p)
    finally:
        d.stop()
        p.stop()


@pytest.fixture(scope="module")
def long_model():
    return Model(str(FGM), threads=1, max_context=LONG_CTX, chunk=256, max_batch=8, weights="auto:16")


def test_without_tokenizer(long_pair):
    c = long_pair
    log = c.decode_worker.log_text()
    assert '"stop_tokens": [1, 106, 50]' in log and '"tokenizer": false' in log  # the Gemma 4 default
    _, _, events = c.run("nt-1", prompt_of(20, 10), 5, greedy(), ignore_eos=True)
    assert all(t.text == "" for t in tokens_of(events)) and events[-1].completion_tokens == 5
    lease = c.reserve("nt-2", 10)
    assert abs(lease.deadline_unix_ms / 1000 - (time.time() + 20)) < 5  # --lease-ms 20000
    pre = c.prefill.Prefill(c.prefill_req("nt-2", prompt_of(20, 10), lease, greedy()), timeout=RPC_TIMEOUT)
    code, msg = status_of(lambda: list(c.decode.Generate(c.gen_req("nt-2", lease, 10, pre, greedy(), 5, stop=["w5"]),
                                                         timeout=RPC_TIMEOUT)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tokenizer" in msg
    c.wait_idle(5)


def test_cancelled_prefill_never_seals_the_slot(long_pair, long_model, long_dir):
    # The prefill stops between chunks; the slot stays unsealed, so Generate refuses it.
    c, n = long_pair, LONG_CTX - 100
    lease = c.reserve("pc", n)
    view = open_shared_arena(long_model, lease.arena_path, lease.n_slots, lease.slot_bytes, long_dir)
    fut = c.prefill.Prefill.future(c.prefill_req("pc", prompt_of(24, n), lease, greedy()), timeout=30)
    end = time.monotonic() + 20
    while view.arena.n_tokens(lease.slot) == 0:  # wait until the first chunks are in
        assert time.monotonic() < end and not fut.done(), "the prefill did not start"
        time.sleep(0.001)
    fut.cancel()
    time.sleep(0.5)
    h = view.arena.header(lease.slot)
    assert not h["sealed"] and h["n_tokens"] < n
    fake = pb.PrefillResponse(first_token=pb.Token(token_id=5))
    code, _ = status_of(lambda: list(c.decode.Generate(c.gen_req("pc", lease, n, fake, greedy(), 4),
                                                       timeout=RPC_TIMEOUT)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "prefill cancelled by the caller" in c.prefill_worker.log_text()
    del view
    c.wait_idle(5)


def _long_stream(c: Client, rid: str, seed: int):
    prompt = prompt_of(seed, 16)
    lease = c.reserve(rid, 16)
    pre = c.prefill.Prefill(c.prefill_req(rid, prompt, lease, greedy()), timeout=RPC_TIMEOUT)
    return lease, c.decode.Generate(c.gen_req(rid, lease, 16, pre, greedy(), 0, ignore_eos=True), timeout=60)


def test_cancel_mid_stream_frees_the_slot(long_pair):
    c = long_pair
    lease, call = _long_stream(c, "cancel-1", 5)
    seen = [next(call) for _ in range(5)]
    assert all(not ev.finish_reason for ev in seen)
    assert c.stats().slots_running == 1
    call.cancel()
    c.wait_idle()
    # The lease is gone with its sequence.
    assert not c.decode.Release(pb.ReleaseRequest(request_id="cancel-1", lease=lease), timeout=RPC_TIMEOUT).released


def test_release_ends_a_running_stream(long_pair):
    c = long_pair
    lease, call = _long_stream(c, "rel-1", 6)
    next(call)
    assert c.decode.Release(pb.ReleaseRequest(request_id="rel-1", lease=lease), timeout=RPC_TIMEOUT).released
    events = list(call)
    assert events[-1].finish_reason == pb.FINISH_REASON_CANCELLED and events[-1].completion_tokens < LONG_CTX - 20
    c.wait_idle()


def test_overwritten_slot_ends_only_its_stream(long_pair, long_model, long_dir):
    # Someone writes a running sequence's slot header behind the decode worker's back: that stream ends with
    # INTERNAL, the stream batched with it goes on unharmed, both slots are freed.
    c, n = long_pair, 400
    prompts = {"victim": prompt_of(40, 20), "bystander": prompt_of(41, 20)}
    reqs = {}
    for name, prompt in prompts.items():
        lease = c.reserve(name, 20)
        pre = c.prefill.Prefill(c.prefill_req(name, prompt, lease, greedy()), timeout=RPC_TIMEOUT)
        reqs[name] = c.gen_req(name, lease, 20, pre, greedy(), n, ignore_eos=True)
    lease = reqs["victim"].lease
    view = open_shared_arena(long_model, lease.arena_path, lease.n_slots, lease.slot_bytes, long_dir)
    calls = {name: c.decode.Generate(r, timeout=RPC_TIMEOUT) for name, r in reqs.items()}
    victim = [next(calls["victim"])]
    # A reset that lands inside a step is overwritten by the step's own header update: keep resetting until
    # one lands between steps.
    done = threading.Event()

    def overwrite() -> None:
        while not done.is_set():
            view.arena.reset(lease.slot)
            time.sleep(0.0002)

    t = threading.Thread(target=overwrite)
    t.start()
    try:
        code, msg = status_of(lambda: victim.extend(calls["victim"]))
    finally:
        done.set()
        t.join()
    assert code == grpc.StatusCode.INTERNAL and "decode failed for this sequence" in msg
    assert len(victim) < n
    bystander = list(calls["bystander"])
    ref = reference(long_model, prompts["bystander"], n, greedy())
    assert [t.token_id for t in tokens_of(bystander)] == [s.token for s in ref]
    del view
    c.wait_idle()


# ---------------------------------------------------------------------------------------------------------------
# SIGKILL, restart, SIGTERM


def _arena_files(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith(PREFIX))


def test_kill_restart_and_drain(tmp_path):
    shm = str(shm_folder("kill"))
    geometry = ["--max-context", str(LONG_CTX), "--chunk", "256", "--shm-dir", shm]
    d = Worker("decode", ["--model", str(FGM), *geometry, "--slots", "2"], tmp_path / "d1.log")
    p = Worker("prefill", ["--model", str(FGM), *geometry], tmp_path / "p1.log")
    workers = [d, p]
    try:
        d.wait_ready()
        p.wait_ready()
        c = Client(d, p)

        # SIGKILL of the prefill worker while calls are in flight: each call errors, none hangs. This test holds the
        # slot's writer lock, so however fast the machine, no call can finish first: the worker's model thread
        # waits for the lock inside the first call and the others queue behind it.
        lease = c.reserve("pk", LONG_CTX - 100)
        locks = SlotLocks(os.open(lease.arena_path, os.O_RDWR), lease.slot_bytes)
        assert locks.try_lock(lease.slot)
        prompt = prompt_of(21, LONG_CTX - 100)
        futures = [c.prefill.Prefill.future(c.prefill_req(f"pk-{i}", prompt, lease, greedy()), timeout=30)
                   for i in range(6)]
        time.sleep(0.3)  # let the calls reach the worker (a call killed before it arrives fails the same way)
        p.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        codes = []
        for f in futures:
            try:
                f.result(timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
        assert time.monotonic() - t0 < 5
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 6
        locks.unlock(lease.slot)
        locks.close()
        assert c.decode.Release(pb.ReleaseRequest(request_id="pk", lease=lease), timeout=RPC_TIMEOUT).released

        # SIGKILL of the decode worker mid-stream: the stream errors within 5 s.
        p = Worker("prefill", ["--model", str(FGM), *geometry], tmp_path / "p2.log")
        workers.append(p)
        p.wait_ready()
        c = Client(d, p)
        _, call = _long_stream(c, "dk", 22)
        for _ in range(3):
            next(call)
        old = _arena_files(shm)
        assert len(old) == 2
        d.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 5
        d.proc.wait(5)
        assert _arena_files(shm) == old  # a SIGKILLed owner cannot clean up

        # A restart sweeps the dead worker's arena: no accumulation.
        d = Worker("decode", ["--model", str(FGM), *geometry, "--slots", "2", "--drain-seconds", "1"],
                   tmp_path / "d2.log")
        workers.append(d)
        d.wait_ready()
        new = _arena_files(shm)
        assert len(new) == 2 and not set(new) & set(old)
        assert "swept stale KV arena file" in d.log_text()

        # SIGTERM drains: new work is refused, a stream that ends within --drain-seconds ends normally, one that
        # would not is cut off with UNAVAILABLE, the arena is unlinked and the process exits 0.
        c = Client(d, p)
        calls = {}
        for name, n in (("short", 50), ("long", LONG_CTX - 30)):
            lease = c.reserve(name, 20)
            pre = c.prefill.Prefill(c.prefill_req(name, prompt_of(23, 20), lease, greedy()), timeout=RPC_TIMEOUT)
            calls[name] = c.decode.Generate(c.gen_req(name, lease, 20, pre, greedy(), n, ignore_eos=True), timeout=60)
        firsts = {name: next(call) for name, call in calls.items()}
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(d.channel)
        while health.Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT).status == \
                health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < t0 + 5, "still SERVING after SIGTERM"
            time.sleep(0.01)
        code, _ = status_of(lambda: c.reserve("late", 10))
        assert code == grpc.StatusCode.UNAVAILABLE
        rest = list(calls["short"])
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and len(tokens_of([firsts["short"], *rest])) == 50
        # The long stream has thousands of tokens to go. Stop the worker until its drain time is over, so that it
        # cannot finish them in that time however fast this machine decodes: once it runs again, the expired drain
        # cuts the stream off.
        d.proc.send_signal(signal.SIGSTOP)
        time.sleep(1.5)
        d.proc.send_signal(signal.SIGCONT)
        long = []
        code, msg = status_of(lambda: long.extend(calls["long"]))
        assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in msg and len(long) < LONG_CTX - 31
        assert 0.9 < time.monotonic() - t0 < 10
        assert d.proc.wait(15) == 0
        assert _arena_files(shm) == []
    finally:
        for w in workers:
            w.stop()
        shutil.rmtree(shm, ignore_errors=True)
