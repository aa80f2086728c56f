"""Anthropic's Message Batches API (/v1/messages/batches): Messages requests run in the background and their
results read back as JSON lines — the Batch API's machinery (batches.py) under Anthropic's names.

`POST /v1/messages/batches` takes {"requests": [{"custom_id", "params"}]} (params: a Messages request; at most
--batch-max-requests of them, custom_ids of 1–64 letters, digits, "-" and "_", each once) and answers the batch at
once, processing_status in_progress. Its requests run as a /v1/batches batch's do — at the lowest priority, at most
--batch-concurrency at once across every batch of the gateway, one refused for want of room tried again — and each
result is the Messages endpoint's own answer: {"custom_id", "result": {"type": "succeeded", "message"} | {"type":
"errored", "error": Anthropic's error envelope} | {"type": "canceled"} | {"type": "expired"}}.

`GET …/{id}` (request_counts: processing, succeeded, errored, canceled, expired; results_url once it has ended),
`GET …` (the caller's batches, newest first: limit 1–1000, after_id, before_id), `POST …/{id}/cancel` (canceling,
then ended with the results it had, the rest canceled), `DELETE …/{id}` (an ended batch and its results; one still
running is a 400) and `GET …/{id}/results` (JSON lines, once ended). A batch ends 24 hours after it was made at the
latest (Anthropic's window), the requests it did not run expired. Per API key, kept and taken up after a restart as
/v1/batches batches are (docs/batches.md).
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Iterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from .auth import request_owner
from .batches import EXPIRED, FINAL, MESSAGES, Batch, Batches
from .limits import read_body
from .offload import Offload
from .protocol import ApiError, invalid, parse_json_body
from .responses import new_id

WINDOW_S = 24 * 3600
CUSTOM_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
KIND = "inline"
MAX_LIST = 1000
CREATE_BODIES = 16   # a create call's body may be this many times --max-body-bytes (64 MiB by default)


def _time(ts: int | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def view(batch: Batch, base_url: str) -> dict:
    """The batch as Anthropic's API shows a message batch."""
    obj = batch.obj
    counts = obj["request_counts"]
    ended = obj["status"] in FINAL
    left = counts["total"] - counts["completed"] - counts["failed"]
    status = "ended" if ended else "canceling" if obj["status"] == "cancelling" else "in_progress"
    ended_at = next((obj[f] for f in ("completed_at", "expired_at", "cancelled_at", "failed_at") if obj[f]), None)
    return {"id": obj["id"], "type": "message_batch", "processing_status": status,
            "request_counts": {"processing": 0 if ended else left, "succeeded": counts["completed"],
                               "errored": counts["failed"] - batch.expired + (left if ended and obj["status"]
                                                                              == "failed" else 0),
                               "canceled": left if obj["status"] == "cancelled" else 0, "expired": batch.expired},
            "ended_at": _time(ended_at), "created_at": _time(obj["created_at"]), "expires_at": _time(obj["expires_at"]),
            "archived_at": None, "cancel_initiated_at": _time(obj["cancelling_at"]),
            "results_url": f"{base_url}/v1/messages/batches/{obj['id']}/results" if ended else None}


def requests_lines(body: dict, max_requests: int) -> bytes:
    """The create call's requests as the JSON lines a batch reads (batches.check_lines), or a 400 naming the first
    bad one."""
    extra = sorted(set(body) - {"requests"})
    if extra:
        raise invalid(f"{extra[0]}: Extra inputs are not permitted", param=extra[0])
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise invalid("requests: a list of at least one request is required", param="requests")
    if len(requests) > max_requests:
        raise invalid(f"requests: at most {max_requests} requests a batch (--batch-max-requests)", param="requests")
    seen: set[str] = set()
    lines = []
    for i, item in enumerate(requests):
        where = f"requests.{i}"
        if not isinstance(item, dict) or set(item) != {"custom_id", "params"}:
            raise invalid(f"{where}: each request is an object of custom_id and params", param=where)
        custom_id, params = item["custom_id"], item["params"]
        if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
            raise invalid(f"{where}.custom_id: 1 to 64 letters, digits, hyphens and underscores",
                          param=where + ".custom_id")
        if custom_id in seen:
            raise invalid(f"{where}.custom_id: {custom_id!r} is used by an earlier request; each must be unique",
                          param=where + ".custom_id")
        if not isinstance(params, dict):
            raise invalid(f"{where}.params: a Messages request object", param=where + ".params")
        seen.add(custom_id)
        lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": MESSAGES, "body": params},
                                ensure_ascii=False))
    return "\n".join(lines).encode() + b"\n"


def results(batches: Batches, batch: Batch) -> Iterator[bytes]:
    """(a thread: StreamingResponse iterates a plain generator off the event loop) The batch's results as JSON
    lines: the answers it wrote, then a line for each request it did not run."""
    answered = set()
    for field in ("output_file_id", "error_file_id"):
        path = batches.files.path(batch.obj[field]) if batch.obj[field] else None
        if path is None or not path.exists():   # none written, or deleted through the Files API
            continue
        with open(path, "rb") as f:
            for raw in f:
                line = json.loads(raw)
                answered.add(line["custom_id"])
                response, error = line["response"], line["error"]
                if field == "output_file_id":
                    result = {"type": "succeeded", "message": response["body"]}
                elif error is not None and error.get("code") == EXPIRED:
                    result = {"type": "expired"}
                else:
                    result = {"type": "errored", "error": response["body"]}
                yield json.dumps({"custom_id": line["custom_id"], "result": result}, ensure_ascii=False).encode() \
                    + b"\n"
    left = {"type": "canceled"} if batch.obj["status"] == "cancelled" else {"type": "errored", "error": {
        "type": "error", "error": {"type": "api_error", "message": "the batch stopped on an internal error before "
                                   "this request ran"}}}
    with open(batches.input_path(batch), "rb") as f:
        for raw in f:
            if raw.strip():
                custom_id = json.loads(raw)["custom_id"]
                if custom_id not in answered:
                    yield json.dumps({"custom_id": custom_id, "result": left}).encode() + b"\n"


def _page(items: list[dict], query) -> dict:
    """Anthropic's list page: newest first, limit (1–1000, default 20), after_id / before_id."""
    limit = query.get("limit", "20")
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= MAX_LIST):
        raise invalid(f"limit: an integer from 1 to {MAX_LIST}", param="limit")
    items = items[::-1]
    ids = [item["id"] for item in items]
    for name in ("after_id", "before_id"):
        at = query.get(name)
        if at is not None:
            if at not in ids:
                raise invalid(f"{name}: no batch with id '{at[:64]}' here", param=name)
            items = items[ids.index(at) + 1:] if name == "after_id" else items[:ids.index(at)]
            ids = [item["id"] for item in items]
    page = items[:int(limit)] if query.get("before_id") is None else items[-int(limit):]
    return {"data": page, "has_more": len(items) > len(page), "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}


def add_message_batch_endpoints(app: FastAPI, batches: Batches, keyed: bool, max_body_bytes: int,
                                body_timeout: float) -> None:
    def base(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    def get(request: Request, batch_id: str) -> Batch:
        try:
            return batches.get(batch_id, request_owner(request, keyed), KIND)
        except ApiError:
            raise ApiError(404, f"message batch {batch_id[:64]!r} not found", param="message_batch_id") from None

    @app.post("/v1/messages/batches")
    async def create(request: Request):
        # The requests are the body: CREATE_BODIES Messages bodies' worth, parsed off the event loop.
        raw = await read_body(request, max_body_bytes * CREATE_BODIES, body_timeout)
        batches.check_room()

        def parse(cancelled):
            body = parse_json_body(raw)
            return requests_lines(body, batches.limits.max_requests), len(body["requests"])

        lines, total = await batches.inference.gw.offload.run(Offload.is_light(len(raw)), parse)
        batch = batches.start_batch(request_owner(request, keyed), new_id("msgbatch_"), MESSAGES, WINDOW_S, None,
                                    completion_window="24h", inline=lines)
        batch.obj["request_counts"]["total"] = total
        return view(batch, base(request))

    @app.get("/v1/messages/batches")
    async def list_batches(request: Request):
        return _page([view(b, base(request)) for b in batches.list(request_owner(request, keyed), KIND)],
                     request.query_params)

    @app.get("/v1/messages/batches/{batch_id}")
    async def retrieve(batch_id: str, request: Request):
        return view(get(request, batch_id), base(request))

    @app.post("/v1/messages/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request):
        batch = get(request, batch_id)
        if batch.obj["status"] not in FINAL:
            batches.cancel(batch)
        return view(batch, base(request))

    @app.delete("/v1/messages/batches/{batch_id}")
    async def delete(batch_id: str, request: Request):
        batch = get(request, batch_id)
        if batch.obj["status"] not in FINAL:
            raise invalid(f"message batch {batch_id} is still processing: cancel it first, then delete it")
        batches.remove(batch)
        return {"id": batch_id, "type": "message_batch_deleted"}

    @app.get("/v1/messages/batches/{batch_id}/results")
    async def batch_results(batch_id: str, request: Request):
        batch = get(request, batch_id)
        if batch.obj["status"] not in FINAL:
            raise invalid(f"message batch {batch_id} has not ended yet: its results come when it has")
        return StreamingResponse(results(batches, batch), media_type="application/x-jsonl")
