"""Hugging Face Gemma 4 / Gemma 3 checkpoint (safetensors + config.json), or a Gemma 3 GGUF → FASTGEM1 .fgm file.

For a Gemma 4 checkpoint the output matches fastgemma's converter run with ``--weights both --group 256`` (or
the chosen options): same tensor set, dtypes, shapes and offsets, and the same blob bytes (the quantisation
arithmetic is reproduced; see quant.py). A GGUF (gguf_source.py) is dequantised and goes through the same
steps; its vocabulary becomes ``<out>.tokenizer.json`` beside the .fgm (sp_tokenizer.py), and its chat template,
if it has one, ``<out>.chat_template.jinja``: the names the services look for beside a model file. A GGUF is stored
``--weights int8g`` by default (q8g, docs/fgm-extensions.md): its symmetric blocks keep their exact values.

Everything is streamed: linears are converted in chunks of whole 16-row blocks and tables in row chunks, and
the checkpoint pages already read are released, so memory stays in the hundreds of MB even for the
262144×8960 per-layer embedding table.
"""
from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from . import quant
from .errors import ConversionError
from .hadamard import rotate_k
from .gguf_source import GgufCheckpoint, is_gguf
from .hf_config import TextConfig, load_text_config, parse_text_config
from .inventory import (PANELED, Linear, Plain, Rope, Table, build_inventory, check_options, default_group, entries_of,
                        fitting_group, header_hadamard, header_kv_cache_dtype, layout_problems, probe_names,
                        quant_bits)
from .progress import byte_progress, stage
from .safetensors import READABLE_DTYPES, Checkpoint
from .writer import FgmWriter

# Where the text decoder lives in the checkpoint: multimodal Gemma4ForConditionalGeneration
# first, then text-only Gemma4ForCausalLM (and older spellings).
_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.", "")

_CHUNK_ELEMS = 1 << 22     # elements per streamed chunk (float64 after rotation: 32 MB)
_PROBE_ELEMS = 1 << 24     # fastgemma measures quant_rel_err on its first chunk of this many elements


def default_threads() -> int:
    """Worker threads when none are asked for: the usable CPUs, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus))


def _rows_per_chunk(k: int, elems: int) -> int:
    """Rows of a linear per chunk: whole 16-row tile blocks, about `elems` elements."""
    return max(quant.TILE_N, elems // k // quant.TILE_N * quant.TILE_N)


def _find_prefix(ckpt: Checkpoint) -> str:
    for p in _PREFIXES:
        if p + "embed_tokens.weight" in ckpt:
            return p
    raise ConversionError(
        f"{ckpt.src}: no Gemma 4 text decoder found: none of "
        + ", ".join(repr(p + "embed_tokens.weight") for p in _PREFIXES[:-1])
        + " is in the checkpoint")


def check_sources(items, ckpt: Checkpoint, prefix: str) -> list[str]:
    """Every missing, misshapen or unreadable checkpoint tensor the items need, one line each."""
    readable = getattr(ckpt, "readable_dtypes", READABLE_DTYPES)
    problems, seen = [], set()
    for it in items:
        if isinstance(it, Rope) or it.source in seen:
            continue
        seen.add(it.source)
        name = prefix + it.source
        want = tuple(it.shape)
        if name not in ckpt:
            problems.append(f"missing: {name} (expected shape {list(want)})")
            continue
        ref = ckpt[name]
        # A scalar may be stored as [] or [1]; anything else must match exactly.
        same = ref.shape == want or (isinstance(it, Plain) and tuple(d for d in ref.shape if d != 1)
                                     == tuple(d for d in want if d != 1))
        if not same:
            problems.append(f"misshapen: {name} is {list(ref.shape)}, expected {list(want)}")
        if ref.dtype not in readable:
            problems.append(f"unsupported dtype: {name} is {ref.dtype} ({', '.join(readable)} needed)")
    return problems


def _ordered_map(fn, args, pool: ThreadPoolExecutor | None, ahead: int):
    """fn over args, results in order; with a pool, at most `ahead` calls in flight (bounded memory)."""
    if pool is None:
        for a in args:
            yield fn(a)
        return
    pending: deque = deque()
    for a in args:
        pending.append(pool.submit(fn, a))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


# numpy's dtype of each float dtype of the format
_FLOAT_DTYPES = {"f16": np.float16, "f32": np.float32}


class _Converter:
    """Fills the planned file. Chunks are converted in worker threads (numpy releases the GIL, so
    reading, rotating, quantising and laying out proceed in parallel); this thread writes the results
    in file order."""

    def __init__(self, cfg: TextConfig, ckpt: Checkpoint, prefix: str, writer: FgmWriter, threads: int):
        self.cfg, self.ckpt, self.prefix, self.w = cfg, ckpt, prefix, writer
        self.probes = set(probe_names(cfg))
        self.rel_err: dict[str, float] = {}
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="fgm-convert") if threads > 1 else None
        self.ahead = threads + 1

    def run(self, items) -> None:
        # q8g/q8ga tensors of one source and group (a tied embedding table and LM head) are the same bytes: they are
        # quantised once, when the first of them comes, and written under every name.
        same: dict[tuple[str, int], list[str]] = {}
        for it in items:
            if isinstance(it, (Linear, Table)) and it.dtype in PANELED:
                same.setdefault((it.source, it.group), []).append(it.name)
        try:
            for it in items:
                if isinstance(it, (Linear, Table)) and it.dtype in PANELED:
                    names = same.pop((it.source, it.group), None)
                    if names:  # else already written with the first of its names
                        n, k = it.shape
                        self.linear(Linear(it.name, it.source, n, k, it.dtype, it.group,
                                           scale_dtype=it.scale_dtype), names)
                elif isinstance(it, Plain):
                    v = self.ckpt.rows(self.prefix + it.source).reshape(it.shape)
                    if it.offset:
                        v = (v.astype(np.float64) + it.offset).astype(np.float32)
                    self.w.write(it.name, v)
                elif isinstance(it, Rope):
                    self.w.write(it.name, self.cfg.rope_inv_freq(it.layer_type))
                elif isinstance(it, Table):
                    self.table(it)
                else:
                    self.linear(it)
        finally:
            if self.pool is not None:
                self.pool.shutdown(cancel_futures=True)

    def table(self, it: Table) -> None:
        src = self.prefix + it.source
        step = max(1, _CHUNK_ELEMS // it.k)
        spans = [(r0, min(it.rows, r0 + step)) for r0 in range(0, it.rows, step)]

        def work(span):
            rows = self.ckpt.rows(src, *span)
            return span, quant.quantize_q8_rows(rows) if it.dtype == "q8r" else quant.encode_q4r(rows)

        for (r0, r1), (blob, scale) in _ordered_map(work, spans, self.pool, self.ahead):
            self.w.write(it.name, blob)
            self.w.write(it.name + ".scale", scale)
            self.ckpt.release(src, r0, r1)

    def linear(self, it: Linear, names: list[str] | None = None) -> None:
        """Quantise and write one linear; a q8g/q8ga one under each of ``names`` (default: its own)."""
        names = names or [it.name]
        src = self.prefix + it.source
        step = _rows_per_chunk(it.k, _CHUNK_ELEMS)
        spans = [(r0, min(it.n, r0 + step)) for r0 in range(0, it.n, step)]
        probes = [nm for nm in names if nm in self.probes]
        probe = bool(probes)
        probe_rows = _rows_per_chunk(it.k, _PROBE_ELEMS)

        # A GGUF's block types that q8g/q8ga hold exactly are read from the blocks (codes, scales, offsets as
        # stored), the others dequantised and rounded to int8 groups.
        exact_rows = getattr(self.ckpt, "q8g_rows", None) if it.dtype in PANELED else None

        def work(span):
            r0, r1 = span
            exact = None if exact_rows is None else exact_rows(src, r0, r1, it.group)
            if exact is not None and (exact[2] is not None) != (it.dtype == "q8ga"):
                raise ConversionError(f"{src}: planned as {it.dtype}, but its blocks say otherwise (internal error)")
            w = self.ckpt.rows(src, r0, r1) if exact is None or probe else None
            if it.hadamard:
                w = rotate_k(w)
            out = {"span": span}
            if it.dtype == "q4g":
                q, s = quant.quantize_q4(w, it.group)
                out["blob"], out["scale"] = quant.pack_nibbles(quant.tile_order(q)), s.T.astype(np.float16)
            elif it.dtype in PANELED:
                q, s, o = exact if exact is not None else (*quant.quantize_q8_groups(w, it.group), None)
                out["blob"], out["scale"] = quant.panel_order(q), s.T
                if it.scale_dtype == "f16":  # the blocks' own f16 scales (Q8gLayout): stored as they are
                    out["scale"] = out["scale"].astype(np.float16)
                    if not np.array_equal(out["scale"].astype(np.float32), s.T):
                        raise ConversionError(f"{src}: planned with f16 scales, but rows [{r0}, {r1}) hold scales "
                                              "that f16 does not (internal error)")
                if o is not None:
                    out["offset"] = o.T
            else:
                q, s = quant.quantize_q8_rows(w)
                out["blob"], out["scale"] = quant.tile_order(q), s
            if probe and r0 < probe_rows:
                # fastgemma's statistic: codes × float32 scales (before the f16 rounding); + offsets for q8ga.
                m = min(r1, probe_rows) - r0
                ref = w[:m].astype(np.float64)
                got = quant.dequantize(q[:m], s[:m])
                if out.get("offset") is not None:
                    got = got + np.repeat(out["offset"].T[:m].astype(np.float64), it.group, axis=1)
                out["err"] = (float(np.sum((ref - got) ** 2)), float(np.sum(ref ** 2)))
            if it.twin:
                q8, s8 = quant.quantize_q8_rows(w)
                out["twin"] = (quant.tile_order(q8), s8)
            return out

        # [K/G, N] scales (q4g, q8g, q8ga) are assembled whole, in the dtype the plan gave them; q8c's go per chunk
        planned = {e.name: e.dtype for e in it.entries()}[it.name + ".scale"]
        scales = None if it.dtype == "q8c" else np.empty((it.k // it.group, it.n), dtype=_FLOAT_DTYPES[planned])
        offsets = np.empty((it.k // it.group, it.n), dtype=np.float32) if it.dtype == "q8ga" else None
        err_num = err_den = 0.0
        for out in _ordered_map(work, spans, self.pool, self.ahead):
            r0, r1 = out["span"]
            for nm in names:
                self.w.write(nm, out["blob"])
            if scales is None:
                self.w.write(it.name + ".scale", out["scale"])
            else:
                scales[:, r0:r1] = out["scale"]   # [K/G, N] is transposed: complete it, then write
            if offsets is not None:
                offsets[:, r0:r1] = out["offset"]
            if "err" in out:
                err_num += out["err"][0]
                err_den += out["err"][1]
            if it.twin:
                self.w.write(it.name + ".i8", out["twin"][0])
                self.w.write(it.name + ".i8.scale", out["twin"][1])
            self.ckpt.release(src, r0, r1)
        if scales is not None:
            for nm in names:
                self.w.write(nm + ".scale", scales)
        if offsets is not None:
            for nm in names:
                self.w.write(nm + ".offset", offsets)
        for nm in probes:
            self.rel_err[nm] = round((err_num / err_den) ** 0.5 if err_den else 0.0, 5)


def _source_defaults(gguf: bool, weights, group, emb_bits) -> tuple[str, int | None, int | None]:
    """Options not given: fastgemma's for a Hugging Face checkpoint (dual, 256, int4 embeddings); int8g for a GGUF
    (its symmetric blocks fit q8g exactly: weights quantised once already are not quantised again)."""
    if weights is None:
        weights = "int8g" if gguf else "dual"
    if emb_bits is None and weights != "int8g":
        emb_bits = 8 if gguf else 4
    return weights, group, emb_bits


def convert_checkpoint(src: str | os.PathLike, out: str | os.PathLike, weights: str | None = None,
                       group: int | None = None, progress: bool = True, threads: int | None = None,
                       emb_bits: int | None = None) -> dict:
    """Convert the Hugging Face checkpoint directory (or GGUF file) ``src`` into the .fgm file ``out``.

    weights: "dual" (FFN int4 + int8 twins, fastgemma's ``--weights both``), "int4" (no twins), "int8" (FFN
    stored int8) or "int8g" (every linear, the LM head and the embedding table q8g: int8 with one scale per row
    and group, unrotated); default dual, int8g for a GGUF. group: for int4, the scale group along K of the FFN
    and LM head, default 256 or the largest multiple of 64 below it dividing every int4 K; for int8g, any
    positive divisor of every K, default 32, and for a GGUF tensor gcd(group, its GGML type's sub-block).
    emb_bits: 4 (q4r table, q4g head) or 8 (q8r table, q8c head); default 4, 8 for a GGUF; not for int8g.
    threads: worker threads (default: the usable CPUs, at most 8); the output does not depend on it.
    All problems with the input (config, missing or misshapen tensors, a group that does not
    divide some K) are found before anything is written and raised as one ConversionError; a
    failure never leaves a file at ``out``. Returns a summary dict (path, bytes, tensors, seconds,
    and for a GGUF the tokenizer and chat template files written beside ``out``).
    """
    t0 = time.perf_counter()
    gguf = is_gguf(src)
    if not gguf and Path(src).suffix.lower() == ".gguf":
        what = "does not exist" if not Path(src).exists() else "does not start with the GGUF magic"
        raise ConversionError(f"{src}: not a GGUF file (it {what})")
    weights, group, emb_bits = _source_defaults(gguf, weights, group, emb_bits)
    check_options(weights, default_group(weights) if group is None else group, emb_bits)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConversionError(f"threads must be a positive integer, got {threads!r}")
    out = Path(out)
    desc = f"convert {out.name}"
    stage(desc, f"reading {src}", progress)

    def plan(cfg: TextConfig, ckpt=None):
        g = fitting_group(cfg, weights, emb_bits) if group is None else group
        # A GGUF's block types fix each int8g tensor's dtype and group (gguf_source.GgufCheckpoint.q8g_layout).
        layout_of = None if ckpt is None or weights != "int8g" else (lambda source: ckpt.q8g_layout(source, g))
        items = build_inventory(cfg, weights, g, emb_bits, layout_of)
        problems = layout_problems(items)
        if problems:
            raise ConversionError(f"this model cannot be stored with --weights {weights} --group {g}", problems)
        return items, cfg.fgm_config(hadamard=header_hadamard(weights), group=g, quant=quant_bits(weights, emb_bits),
                                     kv_cache_dtype=header_kv_cache_dtype(weights))

    # A checkpoint's config.json is checked before its weights are opened; a GGUF holds both.
    cfg = None if gguf else load_text_config(src)
    planned = None if gguf else plan(cfg)
    with (GgufCheckpoint(src) if gguf else Checkpoint(src)) as ckpt:
        if gguf:
            cfg = parse_text_config(ckpt.config(), str(src))
            planned = plan(cfg, ckpt)
        items, header_config = planned
        entries = entries_of(items)
        prefix = _find_prefix(ckpt)
        stage(desc, f"checking {len(items)} tensors against the config", progress)
        problems = check_sources(items, ckpt, prefix)
        if problems:
            raise ConversionError(f"{ckpt.src}: the checkpoint does not match its config "
                                  f"({len(problems)} problem{'s' * (len(problems) > 1)})", problems)
        # The vocabulary first: a GGUF whose tokenizer cannot be rebuilt fails before the long part.
        vocab = ckpt.tokenizer() if gguf else None
        if vocab is not None:
            from .sp_tokenizer import build_tokenizer
            stage(desc, f"building tokenizer.json ({len(vocab.tokens)} tokens)", progress)
            tokenizer = build_tokenizer(vocab)
        with FgmWriter(out) as writer:
            writer.plan(entries, header_config)
            stage(desc, f"writing {writer.payload_bytes / 1e9:.2f} GB of tensors", progress)
            bar = byte_progress(writer.payload_bytes, desc, progress)
            writer.on_write = bar.update
            threads = threads or default_threads()
            try:
                # Parallelism comes from our chunk workers; BLAS threads on top (the rotation is a
                # matrix product) would only oversubscribe the cores and spin.
                with threadpool_limits(limits=1, user_api="blas"):
                    conv = _Converter(cfg, ckpt, prefix, writer, threads)
                    conv.run(items)
                seconds = time.perf_counter() - t0
                writer.finish(header_config, {"convert_s": round(seconds, 1), "quant_rel_err": conv.rel_err})
            finally:
                bar.close()
    summary = {"path": str(out), "bytes": writer.size, "tensors": len(entries),
               "seconds": time.perf_counter() - t0, "quant_rel_err": conv.rel_err}
    if vocab is not None:
        summary.update(_write_beside(out, tokenizer, vocab.chat_template))
    return summary


def _write_beside(out: Path, tokenizer, chat_template: str | None) -> dict:
    """``<out>.tokenizer.json`` and, when there is one, ``<out>.chat_template.jinja`` (replacing a stale one
    from an earlier conversion to the same name, which would otherwise be served with this model)."""
    written = {}
    tok_path = out.with_suffix(".tokenizer.json")
    tmp = tok_path.with_name(f".{tok_path.name}.partial")
    try:
        tokenizer.save(str(tmp))
        os.replace(tmp, tok_path)
    finally:
        tmp.unlink(missing_ok=True)
    written["tokenizer"] = str(tok_path)
    tpl_path = out.with_suffix(".chat_template.jinja")
    if chat_template:
        tpl_path.write_text(chat_template, encoding="utf-8")
        written["chat_template"] = str(tpl_path)
    else:
        tpl_path.unlink(missing_ok=True)
        written["chat_template"] = None
    return written
