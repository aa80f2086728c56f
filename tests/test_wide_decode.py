"""Wide decode: 32 concurrent greedy streams through real prefill and decode workers, decoded in one pass per step,
each equal to the in-process engine's run of it alone; the decode worker's slot count from its KV memory budget
(--kv-cache-bytes, or the default rule), the errors of a budget that cannot work, and one failing row ending alone
(the argmax path against sample(): tests/test_row_sampler.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading

import numpy as np
import pytest

from splitgemma.engine import Model, RowSampler, Sample, open_arena, sample
from splitgemma.serving.detokenize import TextStream
from splitgemma.services.decode.batch import BatchLoop, Sequence, StreamError
from splitgemma.services.decode.slots import SlotTable
from splitgemma.services.decode.capacity import FOLDER_HEADROOM, CapacityError, default_budget, plan
from splitgemma.v1 import serving_pb2 as pb
from test_workers import FGM, RPC_TIMEOUT, Client, Worker, _byte_fallback_tokenizer, _metrics, prompt_of, reference
from tools.procs import SPLITGEMMA, free_ports, private_shm

# A context long enough that no stream can end (it runs until its slot is full) before all 32 have joined: the
# streams are only ever cancelled by the test.
CTX, CHUNK = 1024, 32
N = 32


@pytest.fixture(scope="module")
def slot_bytes():
    return Model(str(FGM), threads=1, max_context=CTX, chunk=CHUNK, max_batch=1).kv_slot_bytes


@pytest.fixture(scope="module")
def wide(tmp_path_factory, slot_bytes):
    """A decode worker whose budget holds 32 slots and a half (default --max-batch), and a prefill worker."""
    logs = tmp_path_factory.mktemp("logs")
    (metrics,) = free_ports(1)
    with private_shm("wide") as d:
        geometry = ["--model", str(FGM), "--max-context", str(CTX), "--chunk", str(CHUNK), "--shm-dir", str(d)]
        dec = Worker("decode", [*geometry, "--kv-cache-bytes", str(N * slot_bytes + slot_bytes // 2),
                                "--metrics-port", str(metrics)], logs / "decode.log")
        pre = Worker("prefill", geometry, logs / "prefill.log")
        try:
            dec.wait_ready()
            pre.wait_ready()
            yield Client(dec, pre, {"decode": metrics})
        finally:
            dec.stop()
            pre.stop()


@pytest.fixture(scope="module")
def ref_model():
    return Model(str(FGM), threads=1, max_context=CTX, chunk=CHUNK, max_batch=1, weights="int4")


def _ready_line(log: str) -> dict:
    return next(json.loads(line) for line in log.splitlines() if '"decode worker ready"' in line)


def test_budget_sets_the_slot_count(wide, slot_bytes):
    st = wide.stats()
    assert (st.slots_total, st.slot_bytes, st.kv_cache_bytes) == (N, slot_bytes, N * slot_bytes + slot_bytes // 2)
    log = wide.decode_worker.log_text()
    ready = _ready_line(log)
    assert (ready["slots"], ready["slot_bytes"], ready["arena_bytes"]) == (N, slot_bytes, N * slot_bytes)
    assert ready["kv_cache_bytes"] == N * slot_bytes + slot_bytes // 2 and ready["rows_per_pass"] >= N
    assert f"KV cache: {N} concurrent sequences × {slot_bytes / 2**20:,.1f} MiB per sequence" in log


def test_32_streams_in_one_pass_each_equal_alone(wide, ref_model):
    greedy = pb.SamplingParams(temperature=0)  # no logprobs: the batch loop's argmax path
    prompts = [prompt_of(500 + i, 5 + i % 7) for i in range(N)]
    calls = []
    try:
        for i, prompt in enumerate(prompts):
            rid = f"wide-{i}"
            lease = wide.reserve(rid, len(prompt))
            pre = wide.prefill.Prefill(wide.prefill_req(rid, prompt, lease, greedy), timeout=RPC_TIMEOUT)
            calls.append(wide.decode.Generate(wide.gen_req(rid, lease, len(prompt), pre, greedy, 0,
                                                           ignore_eos=True), timeout=120))
        # Each stream up to its sixth token from a 32-row step; the earlier ones joined steps with fewer rows.
        got = []
        for call in calls:
            events, wide_steps = [], 0
            while wide_steps < 6:
                ev = next(call)
                assert not ev.finish_reason, "a stream ended before all 32 ran together"
                events.append(ev)
                wide_steps += ev.batch_size == N
            got.append([t.token_id for ev in events for t in ev.tokens])
    finally:
        for call in calls:
            call.cancel()
    st = wide.wait_idle(30)
    assert st.max_batch_seen == N
    print(f"\n{N} streams: {st.steps} decode steps; tokens read per stream {min(map(len, got))}.."
          f"{max(map(len, got))}")
    for i, tokens in enumerate(got):
        assert tokens == [s.token for s in reference(ref_model, prompts[i], len(tokens), greedy)], f"stream {i}"
    values = _metrics(wide.metrics_ports["decode"])
    # One observation of the batch loop's own time per decode step, beside the engine's.
    assert values["splitgemma_decode_host_seconds_count"] == values["splitgemma_decode_step_seconds_count"] == st.steps
    assert values["splitgemma_decode_host_seconds_sum"] == pytest.approx(st.host_seconds)
    assert values["splitgemma_decode_step_seconds_sum"] == pytest.approx(st.decode_seconds)
    assert values["splitgemma_decode_batch_size_bucket{le=\"32.0\"}"] - \
        values["splitgemma_decode_batch_size_bucket{le=\"16.0\"}"] >= 6


def _decode_fails(shm_dir, *options, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*SPLITGEMMA, "decode", "--model", str(FGM), "--max-context", str(CTX), "--chunk",
                           str(CHUNK), "--threads", "1", "--port", "0", "--shm-dir", str(shm_dir), *options],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_budget_errors(shm_dir, slot_bytes):
    r = _decode_fails(shm_dir, "--kv-cache-bytes", str(slot_bytes - 1))
    assert r.returncode == 1
    assert f"splitgemma: error: the KV budget (--kv-cache-bytes {slot_bytes - 1:,}) holds no sequence: one KV slot " \
           f"takes {slot_bytes:,} bytes" in r.stderr
    r = _decode_fails(shm_dir, "--kv-cache-bytes", str(2**60))
    assert r.returncode == 1
    assert f"splitgemma: error: --kv-cache-bytes {2**60:,} exceeds the free space of {shm_dir}" in r.stderr
    r = _decode_fails(shm_dir, "--slots", "2", "--kv-cache-bytes", "1m")
    assert r.returncode == 2 and "argument --kv-cache-bytes: not allowed with argument --slots" in r.stderr
    for bad, why in (("1.5g", "invalid size '1.5g'"), ("0", "must be at least 1 byte"), ("8x", "invalid size")):
        r = _decode_fails(shm_dir, "--kv-cache-bytes", bad)
        assert r.returncode == 2 and why in r.stderr, r.stderr
    r = subprocess.run([*SPLITGEMMA, "up", "--model", str(FGM), "--slots", "2", "--kv-cache-bytes", "1m"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "not allowed with argument --slots" in r.stderr
    assert list(shm_dir.iterdir()) == []  # no arena was left behind


def test_default_budget_rule():
    gib = 2**30
    # The arena folder is the bound (a container's shm_size) ...
    assert default_budget(folder_free=gib, ram=64 * gib, model_bytes=4 * gib) == gib - FOLDER_HEADROOM
    # ... or half of the RAM left once the model's pages stay cached.
    assert default_budget(folder_free=32 * gib, ram=20 * gib, model_bytes=4 * gib) == 8 * gib
    assert default_budget(folder_free=32 * gib, ram=3 * gib, model_bytes=4 * gib) == 0


def test_plan(shm_dir, slot_bytes):
    assert plan(slot_bytes, slots=5, kv_cache_bytes=None, folder=str(shm_dir), model_path=str(FGM)).slots == 5
    c = plan(slot_bytes, slots=None, kv_cache_bytes=3 * slot_bytes - 1, folder=str(shm_dir), model_path=str(FGM))
    assert (c.slots, c.arena_bytes) == (2, 2 * slot_bytes)
    c = plan(slot_bytes, slots=None, kv_cache_bytes=None, folder=str(shm_dir), model_path=str(FGM))
    assert c.slots >= 1 and c.budget >= c.arena_bytes and "available RAM" in c.rule
    with pytest.raises(CapacityError, match="does not exist"):
        plan(slot_bytes, slots=None, kv_cache_bytes=None, folder=str(shm_dir / "nope"), model_path=str(FGM))


class _Metrics:
    """What the batch loop reports per step (DecodeMetrics' two calls), kept."""

    def __init__(self):
        self.batches = []

    def step(self, seconds: float, batch: int, tokens: int) -> None:
        self.batches.append(batch)

    def host(self, seconds: float) -> None:
        pass


class _FailingText(TextStream):
    """A detokenizer that fails on the second token (as tokenizers' DecodeStream once did on a byte-fallback token
    that left a UTF-8 character incomplete, which used to end every row of the step)."""

    pushed = 0

    def push(self, token_id: int):
        self.pushed += 1
        if self.pushed > 1:
            raise ValueError("detokenizer failed")
        return super().push(token_id)


def test_a_failing_row_ends_alone(ref_model):
    """One sequence's detokenizer fails; the batch loop ends that stream with INTERNAL and the others decode on."""
    tok, _ = _byte_fallback_tokenizer()
    bad_text = _FailingText(tok)
    bad_text.push(1)

    async def run():
        arena = open_arena(ref_model, 3)
        prompts = [prompt_of(700 + i, 9) for i in range(3)]
        firsts = [sample(ref_model.prefill(arena, i, p), temperature=0) for i, p in enumerate(prompts)]
        metrics = _Metrics()
        loop = BatchLoop(ref_model, arena, SlotTable(3, stamp=lambda s, g, secret: None, revoke=lambda s: True,
                                                     writing=lambda s: False),
                         asyncio.get_running_loop(), metrics)
        seqs = [Sequence(request_id=f"row-{i}", slot=i, prompt_tokens=9, first=firsts[i] if i else Sample(1, 0, 0, []),
                         sampler=RowSampler(ref_model.vocab_size, temperature=0.0, want_logprob=False),
                         max_tokens=12, max_context=CTX, stop_ids=frozenset(),
                         text=bad_text if i == 0 else None, token_name=str, queue=asyncio.Queue()) for i in range(3)]
        loop.start()
        for q in seqs:
            loop.admit(q)
        got = []
        for q in seqs:
            items = [await asyncio.wait_for(q.queue.get(), RPC_TIMEOUT)]
            while not isinstance(items[-1], StreamError) and not items[-1].finish_reason:
                items.append(await asyncio.wait_for(q.queue.get(), RPC_TIMEOUT))
            got.append(items)
        loop.stop()
        return prompts, got, metrics.batches

    prompts, got, batches = asyncio.run(run())
    assert len(got[0]) == 1 and isinstance(got[0][0], StreamError) and got[0][0].code == "INTERNAL"
    assert "detokenizer failed" in str(got[0][0])
    for i in (1, 2):
        tokens = [t.token_id for ev in got[i] for t in ev.tokens]
        assert got[i][-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert tokens == [s.token for s in reference(ref_model, prompts[i], 12, pb.SamplingParams(temperature=0))]
    assert max(batches) == 2


class _GatedModel:
    """The real model, whose decode steps wait for a gate the test opens: what a slow step looks like, on time."""

    def __init__(self, model: Model):
        self._model = model
        self.gate = threading.Event()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def decode(self, *args, **kwargs):
        self.gate.wait()
        return self._model.decode(*args, **kwargs)


def test_first_token_goes_out_before_the_step(ref_model):
    """A stream's first token (the prefill worker's draw) reaches its queue while the decode step that admitted it
    is still running: time to first token does not wait for a step of the whole batch."""

    async def run():
        gated = _GatedModel(ref_model)
        arena = open_arena(ref_model, 1)
        prompt = prompt_of(710, 9)
        first = sample(ref_model.prefill(arena, 0, prompt), temperature=0)
        loop = BatchLoop(gated, arena, SlotTable(1, stamp=lambda s, g, secret: None, revoke=lambda s: True,
                                                 writing=lambda s: False),
                         asyncio.get_running_loop(), _Metrics())
        seq = Sequence(request_id="row", slot=0, prompt_tokens=9, first=first,
                       sampler=RowSampler(ref_model.vocab_size, temperature=0.0, want_logprob=False),
                       max_tokens=6, max_context=CTX, stop_ids=frozenset(), text=None, token_name=str,
                       queue=asyncio.Queue())
        loop.start()
        loop.admit(seq)
        try:
            early = await asyncio.wait_for(seq.queue.get(), RPC_TIMEOUT)
        finally:
            gated.gate.set()  # the step runs once the first event is in (or the wait has failed)
        items = [early]
        while not items[-1].finish_reason:
            items.append(await asyncio.wait_for(seq.queue.get(), RPC_TIMEOUT))
        loop.stop()
        return prompt, first, items

    prompt, first, items = asyncio.run(run())
    assert [t.token_id for t in items[0].tokens] == [first.token]
    tokens = [t.token_id for ev in items for t in ev.tokens]
    assert tokens == [s.token for s in reference(ref_model, prompt, 6, pb.SamplingParams(temperature=0))]
    assert items[-1].finish_reason == pb.FINISH_REASON_LENGTH
