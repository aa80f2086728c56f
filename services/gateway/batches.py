"""The Batch API (OpenAI's /v1/batches): a file of requests run in the background and answered in files.

A batch names an uploaded file (files.py) of JSON lines, one request each — {"custom_id", "method": "POST", "url":
the batch's endpoint, "body"} — and one endpoint: /v1/chat/completions, /v1/completions or /v1/responses. It checks
every line first (status validating: a file that is not such lines, repeats a custom_id or holds more than
--batch-max-requests fails the batch with the lines named, and nothing runs), then runs the requests (in_progress)
through the endpoints' own code (inference.py) at the lowest priority there is: behind every interactive request in
the workers' queues, whatever the scheduling policy, and at most --batch-concurrency of them at once across every
batch of the gateway, so a batch fills the decode batch's room without taking all of it. Each answer is a line of
the output file (status 2xx) or of the error file (any other, with the endpoint's own error body), in OpenAI's shape
({"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}), in the order they finish; a
request refused for want of room (429, 503: the queue full, a worker restarting) waits and is tried again, never
failed for it. Then the two files are added to the Files API (finalizing) and the batch is completed, with its
request counts and its token usage.

`POST /v1/batches/{id}/cancel` stops it (cancelling: the requests in flight are cancelled, their decode slots freed)
and it ends cancelled, with the answers it had. A batch still running when its completion window closes
(completion_window, from its creation; OpenAI takes only "24h", this server any window from 1 s to 7 days) ends
expired: the answers it had, and a batch_expired error line for each request it did not run.

Anthropic's Message Batches (message_batches.py) run here too: their requests come inline in the create call and
are kept beside the record (`kind` "inline"), each runs as POST /v1/messages.

Kept in the Files API's folder: each batch's object (`batch_<id>.json`, `msgbatch_<id>.json`) and the two files it is
writing. A gateway
restarted on the same folder (--files-dir) takes up every unfinished batch where it stood: the answers already
written stay, the rest run. Per API key, as the files are; at most MAX_ACTIVE batches unfinished per gateway (more:
429) and MAX_KEPT finished ones listed (the oldest forgotten first; their files stay until deleted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from fastapi import FastAPI, Request

from .auth import request_owner
from .files import MAX_EXPIRY_S, MIN_EXPIRY_S, OUTPUT_PURPOSE, FileStore
from .files import not_found as file_not_found
from .limits import read_body
from .messages import error_body
from .protocol import LOWEST_PRIORITY, ApiError, invalid, parse_json_body
from .responses import check_metadata, list_page, new_id

if TYPE_CHECKING:
    from .inference import Inference

log = logging.getLogger("splitgemma.gateway")

# What a batch's requests may be, and the prefix of their ids. /v1/messages: Anthropic's Message Batches
# (message_batches.py), not a /v1/batches endpoint.
ENDPOINTS = {"/v1/chat/completions": "chatcmpl-", "/v1/completions": "cmpl-", "/v1/responses": "resp_"}
MESSAGES = "/v1/messages"
PREFIXES = {**ENDPOINTS, MESSAGES: "msg_"}
BATCH_PRIORITY = LOWEST_PRIORITY
MAX_ACTIVE = 64                  # unfinished batches per gateway
MAX_KEPT = 2000                  # finished batches listed (a few kB of memory each)
MAX_LINE_ERRORS = 100            # validation errors reported of a bad file
MAX_CUSTOM_ID = 512
WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400
RETRY_MIN_S, RETRY_MAX_S = 0.5, 30.0
FINAL = ("completed", "failed", "expired", "cancelled")
EXPIRED = "batch_expired"   # the error code of a request the completion window closed on


@dataclass
class BatchLimits:
    concurrency: int = 8            # requests of batches running at once (0: the Batch API is off)
    max_requests: int = 50000       # lines a batch's file may hold (OpenAI's bound)


@dataclass
class Line:
    number: int                     # 1-based, as the error list names it
    custom_id: str
    offset: int
    length: int


def parse_window(text) -> int:
    m = WINDOW.match(text) if isinstance(text, str) else None
    seconds = int(m.group(1)) * WINDOW_UNITS[m.group(2)] if m else 0
    if not 1 <= seconds <= MAX_WINDOW_S:
        raise invalid("completion_window must be a duration such as 24h (a number and s, m, h or d; at most 7 days)",
                      param="completion_window", code="invalid_value")
    return seconds


def check_lines(source: BinaryIO, endpoint: str, max_requests: int) -> tuple[list[Line], list[dict]]:
    """The requests of a batch's input file, or the errors that fail it (OpenAI's batch error objects)."""
    lines: list[Line] = []
    errors: list[dict] = []
    seen: set[str] = set()

    def error(code: str, message: str, number: int | None, param: str | None = None) -> None:
        if len(errors) < MAX_LINE_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": number})

    offset = 0
    for number, raw in enumerate(source, 1):
        at, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        if len(lines) == max_requests:
            error("too_many_requests", f"the file holds more than {max_requests} requests, the most a batch may "
                  "hold (--batch-max-requests)", number)
            break
        try:
            item = json.loads(raw)
        except ValueError:
            error("invalid_json_line", "this line is not a JSON object", number)
            continue
        if not isinstance(item, dict):
            error("invalid_json_line", "this line is not a JSON object", number)
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            error("invalid_request", f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters", number,
                  "custom_id")
        elif custom_id in seen:
            error("duplicate_custom_id", f"the custom_id {custom_id!r} is used by an earlier line", number,
                  "custom_id")
        if item.get("method") != "POST":
            error("invalid_request", "method must be POST", number, "method")
        if item.get("url") != endpoint:
            error("mismatched_endpoint", f"url must be the batch's endpoint, {endpoint}", number, "url")
        if not isinstance(item.get("body"), dict):
            error("invalid_request", "body must be a JSON object: the endpoint's request", number, "body")
        if isinstance(custom_id, str):
            seen.add(custom_id)
        lines.append(Line(number, str(custom_id), at, len(raw)))
    if not lines and not errors:
        error("empty_file", "the file holds no requests", None)
    return lines, errors


def tally(usage: dict, answer: dict) -> None:
    """Adds a 2xx answer's token usage (chat and completions' names, or the Responses API's) to the batch's."""
    used = (answer.get("body") or {}).get("usage") or {}
    prompt = used.get("input_tokens", used.get("prompt_tokens", 0)) or 0
    output = used.get("output_tokens", used.get("completion_tokens", 0)) or 0
    cached = (used.get("input_tokens_details") or used.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (used.get("output_tokens_details") or used.get("completion_tokens_details") or {}) \
        .get("reasoning_tokens") or 0
    usage["input_tokens"] += prompt
    usage["output_tokens"] += output
    usage["total_tokens"] += prompt + output
    usage["input_tokens_details"]["cached_tokens"] += cached
    usage["output_tokens_details"]["reasoning_tokens"] += reasoning


def empty_usage() -> dict:
    return {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}


class Batch:
    """One batch: its object (OpenAI's, as answered; message_batches.py shows Anthropic's view of it), its owner,
    where its requests come from (`kind` "file": its input file; "inline": the requests the create call held, kept
    beside it), and while it runs its task and its answers so far."""

    def __init__(self, obj: dict, owner: str, output_expires_after: int | None, kind: str = "file"):
        self.obj = obj
        self.owner = owner
        self.output_expires_after = output_expires_after
        self.kind = kind
        self.task: asyncio.Task | None = None
        self.answered: set[str] = set()      # custom_ids with a line in the output or the error file
        self.expired = 0                     # of the error file's lines, those of requests the window closed on

    @property
    def id(self) -> str:
        return self.obj["id"]

    def record(self) -> dict:
        return {"object": self.obj, "owner": self.owner, "output_expires_after": self.output_expires_after,
                "kind": self.kind}


class Batches:
    def __init__(self, files: FileStore, inference: "Inference", limits: BatchLimits | None = None):
        self.files = files
        self.inference = inference
        self.limits = limits or BatchLimits()
        self._batches: dict[str, Batch] = {}  # oldest first
        self._slots = asyncio.Semaphore(max(self.limits.concurrency, 1))

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def enabled(self) -> bool:
        return self.limits.concurrency > 0

    # -- the folder ---------------------------------------------------------------------------------------------

    def _path(self, batch_id: str, what: str) -> Path:
        return self.files.folder / f"{batch_id}.{what}"

    def _save(self, batch: Batch) -> None:
        part = self._path(batch.id, "json.part")
        part.write_text(json.dumps(batch.record()))
        os.replace(part, self._path(batch.id, "json"))

    def start(self) -> None:
        """Reads the batches the folder holds; those unfinished run again from where they stood."""
        records = []
        for path in [*self.files.folder.glob("batch_*.json"), *self.files.folder.glob("msgbatch_*.json")]:
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                log.warning("an unreadable batch record was skipped", extra={"path": str(path)})
        for rec in sorted(records, key=lambda r: r["object"]["created_at"]):
            batch = Batch(rec["object"], rec["owner"], rec.get("output_expires_after"), rec.get("kind", "file"))
            self._batches[batch.id] = batch
            if batch.obj["status"] not in FINAL:
                log.info("batch taken up again", extra={"batch": batch.id, "status": batch.obj["status"]})
                self._launch(batch)

    async def close(self) -> None:
        """Stops the running batches where they stand (a gateway started on the same folder goes on with them)."""
        tasks = [b.task for b in self._batches.values() if b.task is not None and not b.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the API ------------------------------------------------------------------------------------------------

    def create(self, owner: str, body: dict) -> dict:
        """POST /v1/batches."""
        self.check_room()
        known = {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}
        extra = sorted(set(body) - known)
        if extra:
            raise invalid(f"Unrecognized request argument supplied: {extra[0]}", param=extra[0],
                          code="unknown_parameter")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str):
                raise invalid(f"Missing required parameter: '{name}'.", param=name,
                              code="missing_required_parameter")
        endpoint = body["endpoint"]
        if endpoint not in ENDPOINTS:
            raise invalid(f"endpoint must be one of {', '.join(ENDPOINTS)} here, not {endpoint[:64]!r}",
                          param="endpoint", code="invalid_value")
        window = parse_window(body["completion_window"])
        metadata = check_metadata(body.get("metadata"))
        output_expires_after = self._output_expiry(body.get("output_expires_after"))
        source = self.files.get(body["input_file_id"], owner)
        if source is None:
            raise file_not_found(body["input_file_id"], "input_file_id")
        if source["purpose"] != "batch":
            raise invalid(f"the file {source['id']} was uploaded with purpose {source['purpose']!r}; a batch reads "
                          "files of purpose 'batch'", param="input_file_id", code="invalid_value")
        return self.start_batch(owner, new_id("batch_"), endpoint, window, source["id"],
                                completion_window=body["completion_window"], metadata=metadata,
                                output_expires_after=output_expires_after).obj

    def check_room(self) -> None:
        if not self.enabled:
            raise invalid("this gateway runs no batches (--batch-concurrency 0)", code="invalid_value")
        if sum(1 for b in self._batches.values() if b.obj["status"] not in FINAL) >= MAX_ACTIVE:
            raise ApiError(429, f"this gateway runs at most {MAX_ACTIVE} batches at once; retry when one has ended",
                           retry_after=60.0)

    def start_batch(self, owner: str, batch_id: str, endpoint: str, window: int, input_file_id: str | None, *,
                    completion_window: str, metadata: dict | None = None, output_expires_after: int | None = None,
                    inline: bytes | None = None) -> Batch:
        """A new batch, running: of the uploaded file `input_file_id`, or of the `inline` requests (JSON lines,
        kept beside its record)."""
        now = int(time.time())
        obj = {"id": batch_id, "object": "batch", "endpoint": endpoint, "model": None, "errors": None,
               "input_file_id": input_file_id, "completion_window": completion_window,
               "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
               "in_progress_at": None, "expires_at": now + window, "finalizing_at": None, "completed_at": None,
               "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": 0, "completed": 0, "failed": 0}, "usage": empty_usage(),
               "metadata": metadata or {}}
        batch = Batch(obj, owner, output_expires_after, "file" if inline is None else "inline")
        if inline is not None:
            part = self._path(batch_id, "input.part")
            part.write_bytes(inline)
            os.replace(part, self.input_path(batch))
        self._batches[batch.id] = batch
        self._save(batch)
        self._forget_old()
        self._launch(batch)
        return batch

    def _launch(self, batch: Batch) -> None:
        batch.task = asyncio.ensure_future(self._run(batch))
        batch.task.add_done_callback(lambda _: setattr(batch, "task", None))   # a finished one holds nothing

    def input_path(self, batch: Batch) -> Path:
        return self._path(batch.id, "input") if batch.kind == "inline" else self.files.path(batch.obj["input_file_id"])

    def remove(self, batch: Batch) -> None:
        """Forgets a finished batch: its record, its inline requests and its output files."""
        del self._batches[batch.id]
        for what in ("json", "input"):
            self._path(batch.id, what).unlink(missing_ok=True)
        for field in ("output_file_id", "error_file_id"):
            if batch.obj[field]:
                self.files.delete(batch.obj[field], batch.owner)

    @staticmethod
    def _output_expiry(value) -> int | None:
        if value is None:
            return None
        if not isinstance(value, dict) or value.get("anchor") != "created_at" or set(value) - {"anchor", "seconds"}:
            raise invalid("output_expires_after must be {anchor: created_at, seconds: N}",
                          param="output_expires_after", code="invalid_value")
        seconds = value.get("seconds")
        if not isinstance(seconds, int) or isinstance(seconds, bool) or not MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S:
            raise invalid(f"output_expires_after.seconds must be an integer from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}",
                          param="output_expires_after.seconds", code="invalid_value")
        return seconds

    def _forget_old(self) -> None:
        finished = [b for b in self._batches.values() if b.obj["status"] in FINAL]
        for batch in finished[:max(0, len(finished) - MAX_KEPT)]:
            del self._batches[batch.id]
            for what in ("json", "input"):
                self._path(batch.id, what).unlink(missing_ok=True)

    def get(self, batch_id: str, owner: str, kind: str = "file") -> Batch:
        batch = self._batches.get(batch_id)
        if batch is None or batch.owner != owner or batch.kind != kind:
            raise ApiError(404, f"No batch found with id '{batch_id[:64]}'.", param="batch_id", code="not_found")
        return batch

    def list(self, owner: str, kind: str = "file") -> list[Batch]:
        return [b for b in self._batches.values() if b.owner == owner and b.kind == kind]

    def cancel(self, batch: Batch) -> None:
        status = batch.obj["status"]
        if status in ("cancelling", "cancelled"):
            return
        if status in FINAL:
            raise ApiError(409, f"Cannot cancel a batch with status '{status}'.", code="invalid_state")
        self._set(batch, "cancelling")
        if batch.task is not None:
            batch.task.cancel()   # the task ends it: cancelled, with the answers it has

    def _set(self, batch: Batch, status: str, **fields) -> None:
        at = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
              "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
              "cancelled": "cancelled_at"}[status]
        batch.obj.update(status=status, **{at: int(time.time())}, **fields)
        self._save(batch)
        log.info("batch %s", status, extra={"batch": batch.id, **batch.obj["request_counts"]})

    # -- running ------------------------------------------------------------------------------------------------

    async def _run(self, batch: Batch) -> None:
        obj = batch.obj
        source = None
        try:
            if batch.kind == "file" and self.files.get(obj["input_file_id"], batch.owner) is None:
                self._set(batch, "failed", errors={"object": "list", "data": [
                    {"code": "input_file_missing", "message": f"the input file {obj['input_file_id']} is gone "
                     "(deleted or expired) before the batch ran", "param": "input_file_id", "line": None}]})
                return
            # Held open: the file may be deleted while the batch runs, its bytes stay readable here.
            source = open(self.input_path(batch), "rb")
            lines, errors = await asyncio.to_thread(check_lines, source, obj["endpoint"], self.limits.max_requests)
            if errors:
                self._set(batch, "failed", errors={"object": "list", "data": errors})
                return
            obj["model"] = self.inference.gw.config.model_name
            obj["request_counts"]["total"] = len(lines)
            outputs = {what: self._path(batch.id, what) for what in ("output", "errors")}
            await asyncio.to_thread(self._reread, batch, outputs)
            if obj["status"] == "validating":
                self._set(batch, "in_progress")
            if obj["status"] == "in_progress":
                await self._answer(batch, lines, source, outputs)   # ends it expired if its window closes first
            if obj["status"] == "in_progress":
                self._set(batch, "finalizing")
            self._finish(batch, outputs, "cancelled" if obj["status"] == "cancelling" else "completed")
        except asyncio.CancelledError:
            if obj["status"] == "cancelling":
                self._finish(batch, {w: self._path(batch.id, w) for w in ("output", "errors")}, "cancelled")
            else:
                raise  # the gateway stops: the batch stays as it stands, for the next start on this folder
        except Exception:
            log.exception("a batch failed", extra={"batch": batch.id})
            self._set(batch, "failed", errors={"object": "list", "data": [
                {"code": "server_error", "message": "the batch stopped on an internal error; the answers it had are "
                 "in its files", "param": None, "line": None}]})
            self._finish(batch, {w: self._path(batch.id, w) for w in ("output", "errors")}, None)
        finally:
            if source is not None:
                source.close()

    def _reread(self, batch: Batch, outputs: dict[str, Path]) -> None:
        """(a thread) The answers already written (a batch taken up again), counted; a line cut short by a stop
        mid-write is dropped, its request runs again."""
        counts = batch.obj["request_counts"]
        counts["completed"] = counts["failed"] = batch.expired = 0
        batch.obj["usage"] = empty_usage()
        for what, path in outputs.items():
            if not path.exists():
                continue
            data = path.read_bytes()
            keep = data[:data.rfind(b"\n") + 1]
            if len(keep) != len(data):
                with open(path, "r+b") as f:
                    f.truncate(len(keep))
            for raw in keep.splitlines():
                answer = json.loads(raw)
                batch.answered.add(answer["custom_id"])
                counts["completed" if what == "output" else "failed"] += 1
                batch.expired += (answer["error"] or {}).get("code") == EXPIRED
                if what == "output":
                    tally(batch.obj["usage"], answer["response"])

    async def _answer(self, batch: Batch, lines: list[Line], source: BinaryIO, outputs: dict[str, Path]) -> None:
        """Runs every request not answered yet, at most the gateway's batch concurrency at once (across batches),
        until all are answered or the completion window closes."""
        files = {what: open(path, "ab") for what, path in outputs.items()}
        running: set[asyncio.Task] = set()
        failed: list[asyncio.Task] = []
        try:
            deadline = batch.obj["expires_at"]
            for line in lines:
                if line.custom_id in batch.answered:
                    continue
                try:
                    await asyncio.wait_for(self._slots.acquire(), max(0.0, deadline - time.time()))
                except TimeoutError:
                    break
                source.seek(line.offset)
                request = json.loads(source.read(line.length))
                task = asyncio.ensure_future(self._one(batch, line, request["body"], files))
                running.add(task)
                task.add_done_callback(lambda t: (running.discard(t), self._slots.release(),
                                                  t.cancelled() or t.exception() is None or failed.append(t)))
                if failed:
                    break
            if running:
                await asyncio.wait(set(running), timeout=max(0.0, deadline - time.time()))
            if failed:   # an answer could not be written (the disk full?): the batch fails, with what it has
                raise failed[0].exception()
            if time.time() >= deadline and len(batch.answered) < len(lines):
                for task in list(running):
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                for line in lines:
                    if line.custom_id not in batch.answered:
                        self._write(batch, files, line, None, {
                            "code": EXPIRED, "message": "This request could not be executed before the "
                            "completion window expired."})
                        batch.expired += 1
                self._set(batch, "expired")
        finally:
            for task in list(running):
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            for f in files.values():
                f.close()

    async def _one(self, batch: Batch, line: Line, body: dict, files: dict[str, BinaryIO]) -> None:
        """One request of a batch, answered with the endpoint's own code; tried again while it finds no room."""
        endpoint = batch.obj["endpoint"]
        rid = PREFIXES[endpoint] + os.urandom(16).hex()
        delay = RETRY_MIN_S
        with self.inference.gw.tracer.start_as_current_span(f"batch {endpoint}", attributes={
                "splitgemma.batch.id": batch.id, "splitgemma.batch.custom_id": line.custom_id}):
            while True:
                status, answer, retry_after = await self._call(endpoint, body, rid, batch.owner)
                if status not in (429, 503):
                    break
                await asyncio.sleep(max(delay, retry_after or 0.0))
                delay = min(delay * 2, RETRY_MAX_S)
        self._write(batch, files, line, {"status_code": status, "request_id": rid, "body": answer}, None)

    async def _call(self, endpoint: str, body: dict, rid: str, owner: str) -> tuple[int, dict, float | None]:
        """(status, body, retry after) of one request through the endpoint's code, at the batch priority."""
        refusal = None
        if body.get("stream"):
            refusal = invalid("stream is not available in a batch: each answer is a line of the output file",
                              param="stream", code="invalid_value")
        elif endpoint == "/v1/responses" and body.get("background"):
            refusal = invalid("background is not available in a batch: the batch itself runs in the background",
                              param="background", code="invalid_value")
        if refusal is not None:
            return refusal.status, error_body(refusal, rid) if endpoint == MESSAGES else refusal.body(), None
        raw = json.dumps(body, ensure_ascii=False).encode()
        inference = self.inference
        limit = inference.gw.config.max_body_bytes
        if len(raw) > limit:   # as the endpoint refuses such a body (--max-body-bytes)
            e = ApiError(413, f"the request body is {len(raw)} bytes; the limit is {limit}", code="request_too_large")
            return e.status, error_body(e, rid) if endpoint == MESSAGES else e.body(), None
        try:
            if endpoint == "/v1/chat/completions":
                response = await inference.chat_completions(raw, rid, BATCH_PRIORITY)
            elif endpoint == "/v1/completions":
                response = await inference.completions(raw, rid, BATCH_PRIORITY)
            elif endpoint == "/v1/responses":
                response = await inference.responses(raw, rid, owner, BATCH_PRIORITY)
            else:
                response = await inference.messages(raw, rid, BATCH_PRIORITY)
            return response.status_code, json.loads(response.body), None
        except ApiError as e:
            return e.status, error_body(e, rid) if endpoint == MESSAGES else e.body(), e.retry_after
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unexpected error in a batch request", extra={"request_id": rid})
            return 500, ApiError(500, f"internal server error (request id {rid})").body(), None

    def _write(self, batch: Batch, files: dict[str, BinaryIO], line: Line, response: dict | None,
               error: dict | None) -> None:
        ok = response is not None and 200 <= response["status_code"] < 300
        answer = {"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": response, "error": error}
        out = files["output" if ok else "errors"]
        out.write(json.dumps(answer, ensure_ascii=False).encode() + b"\n")
        out.flush()
        batch.answered.add(line.custom_id)
        batch.obj["request_counts"]["completed" if ok else "failed"] += 1
        if ok:
            tally(batch.obj["usage"], response)

    def _finish(self, batch: Batch, outputs: dict[str, Path], status: str | None) -> None:
        """The files written so far into the Files API, then the batch's end state (None: already set)."""
        expires = int(time.time()) + batch.output_expires_after if batch.output_expires_after else None
        for what, field in (("output", "output_file_id"), ("errors", "error_file_id")):
            path = outputs[what]
            if path.exists() and path.stat().st_size:
                name = f"{batch.id}_{'output' if what == 'output' else 'error'}.jsonl"
                batch.obj[field] = self.files.add(batch.owner, path, name, OUTPUT_PURPOSE, expires)["id"]
            else:
                path.unlink(missing_ok=True)
        if status is not None and batch.obj["status"] not in FINAL:
            self._set(batch, status)
        else:
            self._save(batch)
        batch.answered = set()   # what it answered is in its files now


def add_batch_endpoints(app: FastAPI, batches: Batches, keyed: bool, max_body_bytes: int,
                        body_timeout: float) -> None:
    @app.post("/v1/batches")
    async def create(request: Request):
        body = parse_json_body(await read_body(request, max_body_bytes, body_timeout))
        return batches.create(request_owner(request, keyed), body)

    @app.get("/v1/batches")
    async def list_batches(request: Request):
        return list_page([b.obj for b in batches.list(request_owner(request, keyed))], request.query_params)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve(batch_id: str, request: Request):
        return batches.get(batch_id, request_owner(request, keyed)).obj

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request):
        batch = batches.get(batch_id, request_owner(request, keyed))
        batches.cancel(batch)
        return batch.obj
