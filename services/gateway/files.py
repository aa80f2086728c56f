"""The Files API (OpenAI's /v1/files): the files clients upload for batches, and the output and error files the
batches write (batches.py).

On disk, in one folder (--files-dir; by default a temporary folder of the gateway's own, removed when it stops):
each file is `<id>` (its bytes, as uploaded) and `<id>.json` (its file object and its owner), written in that order
and the object last by a rename, so a gateway restarted on the same folder finds every file it had answered for, and
no half-written one. Bounded by --files-mb: an upload that would take the folder past it is refused (413) — uploads
are the clients' data, never evicted to make room — while a batch's output is written whatever the bound (it
answers requests the batch already took) and counts against the next upload. A file may expire (`expires_after` on
upload, `output_expires_after` on a batch): it is gone from then on, and its bytes are removed at the next sweep.

Per API key as the stored responses are: a file is seen only with the key that uploaded it (another key gets the
404 of an unknown id); without keys the API is open and so are the files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.datastructures import Headers
from starlette.formparsers import MultiPartException, MultiPartParser

from .auth import request_owner
from .limits import stream_body
from .protocol import ApiError, invalid
from .responses import list_page, new_id

log = logging.getLogger("splitgemma.gateway")

PURPOSES = ("batch",)          # what an upload may be for here: a batch's input
OUTPUT_PURPOSE = "batch_output"
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600   # OpenAI's bounds on expires_after.seconds
MAX_LIST = 10000               # OpenAI's largest (and default) page of files
FORM_OVERHEAD = 64 << 10       # a form's bytes beside its file's: boundaries, part heads, purpose, expires_after


@dataclass
class FileLimits:
    folder: str = ""           # "": a temporary folder, removed when the gateway stops
    megabytes: int = 1024      # the folder's bound, for uploads


def not_found(file_id: str, param: str = "file_id") -> ApiError:
    return ApiError(404, f"No such File object: {file_id[:64]}", param=param, code="not_found")


class FileStore:
    def __init__(self, limits: FileLimits | None = None):
        self.limits = limits or FileLimits()
        self._temporary = not self.limits.folder
        self.folder = Path(tempfile.mkdtemp(prefix="splitgemma-files-") if self._temporary else self.limits.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._max_bytes = self.limits.megabytes << 20
        # id → {"object": the file object, "owner": …}, oldest first; read and changed on the event loop only
        self._files: dict[str, dict] = {}
        for meta in sorted(self.folder.glob("file-*.json"), key=lambda p: p.stat().st_mtime):
            try:
                entry = json.loads(meta.read_text())
                if (self.folder / entry["object"]["id"]).is_file():
                    self._files[entry["object"]["id"]] = entry
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("an unreadable file entry was skipped", extra={"path": str(meta)})
        self.sweep()

    def __len__(self) -> int:
        return len(self._files)

    def close(self) -> None:
        if self._temporary:
            shutil.rmtree(self.folder, ignore_errors=True)

    @property
    def used(self) -> int:
        return sum(e["object"]["bytes"] for e in self._files.values())

    def path(self, file_id: str) -> Path:
        return self.folder / file_id

    def sweep(self) -> None:
        """Removes the files whose time has passed."""
        now = time.time()
        for file_id in [i for i, e in self._files.items() if (e["object"].get("expires_at") or now + 1) <= now]:
            self._remove(file_id)

    def _remove(self, file_id: str) -> None:
        del self._files[file_id]
        for p in (self.folder / (file_id + ".json"), self.folder / file_id):
            p.unlink(missing_ok=True)

    def get(self, file_id: str, owner: str) -> dict | None:
        """The file object, if `owner` may see it and it has not expired."""
        entry = self._files.get(file_id)
        if entry is None or entry["owner"] != owner:
            return None
        expires = entry["object"].get("expires_at")
        if expires is not None and expires <= time.time():
            self.sweep()
            return None
        return entry["object"]

    def list(self, owner: str, purpose: str | None) -> list[dict]:
        self.sweep()
        return [e["object"] for e in self._files.values()
                if e["owner"] == owner and (purpose is None or e["object"]["purpose"] == purpose)]

    def delete(self, file_id: str, owner: str) -> bool:
        if self.get(file_id, owner) is None:
            return False
        self._remove(file_id)
        return True

    def add(self, owner: str, source: Path, filename: str, purpose: str, expires_at: int | None = None) -> dict:
        """Takes the finished file at `source` (moved, not copied: it must be in this folder's file system) as a new
        file of `owner`'s; returns its object."""
        file_id = new_id("file-")
        obj = {"id": file_id, "object": "file", "bytes": source.stat().st_size, "created_at": int(time.time()),
               "filename": filename, "purpose": purpose, "status": "processed", "expires_at": expires_at,
               "status_details": None}
        os.replace(source, self.folder / file_id)
        entry = {"object": obj, "owner": owner}
        meta = self.folder / (file_id + ".json.part")
        meta.write_text(json.dumps(entry))
        os.replace(meta, self.folder / (file_id + ".json"))
        self._files[file_id] = entry
        return obj

    def scratch(self, name: str) -> Path:
        """A path in the folder for a file being written (by an upload, by a batch), to add() when it is done."""
        return self.folder / f"{name}.part"

    async def upload(self, request: Request, owner: str, idle_timeout: float) -> dict:
        """POST /v1/files: the multipart form's `file` (streamed to disk), `purpose` and `expires_after`."""
        headers = Headers(scope=request.scope)
        if not headers.get("content-type", "").startswith("multipart/form-data"):
            raise invalid("upload the file as multipart/form-data, with fields file and purpose", param="file",
                          code="invalid_value")
        room = self._max_bytes - self.used
        # The form's other fields are a few bytes; the file streams to a temporary file of starlette's, which moves
        # here once the purpose is known to be good.
        body = stream_body(request, max(room, 0) + FORM_OVERHEAD, idle_timeout, self._full_message)
        parser = MultiPartParser(headers, body, max_files=1, max_fields=8, max_part_size=4096)
        try:
            form = await parser.parse()
        except MultiPartException as e:
            raise invalid(f"the upload is not a well-formed multipart form: {e}", param="file") from None
        try:
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise invalid("the form has no file field", param="file", code="missing_required_parameter")
            purpose = form.get("purpose")
            if purpose not in PURPOSES:
                raise invalid(f"purpose must be one of {', '.join(PURPOSES)} here (the files this server reads are "
                              f"batches' inputs), not {str(purpose)[:64]!r}", param="purpose", code="invalid_value")
            expires_at = self._expiry(form)
            upload.file.seek(0, os.SEEK_END)
            size = upload.file.tell()
            if size > room:
                raise ApiError(413, self._full_message(), code="request_too_large")
            upload.file.seek(0)
            part = self.scratch(new_id("upload-"))
            with open(part, "wb") as out:
                shutil.copyfileobj(upload.file, out, 1 << 20)
            name = os.path.basename(upload.filename or "") or "upload"
            return self.add(owner, part, name[:256], purpose, expires_at)
        finally:
            await form.close()

    def _full_message(self) -> str:
        return (f"the upload does not fit: the gateway's files take {self.used >> 20} MB of the "
                f"{self.limits.megabytes} MB it keeps (--files-mb); delete files you no longer need")

    @staticmethod
    def _expiry(form) -> int | None:
        anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
        if anchor is None and seconds is None:
            return None
        if anchor != "created_at":
            raise invalid("expires_after.anchor must be created_at", param="expires_after.anchor",
                          code="invalid_value")
        if not (isinstance(seconds, str) and seconds.isascii() and seconds.isdigit()
                and MIN_EXPIRY_S <= int(seconds) <= MAX_EXPIRY_S):
            raise invalid(f"expires_after.seconds must be an integer from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}",
                          param="expires_after.seconds", code="invalid_value")
        return int(time.time()) + int(seconds)


def add_file_endpoints(app: FastAPI, store: FileStore, keyed: bool, idle_timeout: float) -> None:
    @app.post("/v1/files")
    async def upload(request: Request):
        return await store.upload(request, request_owner(request, keyed), idle_timeout)

    @app.get("/v1/files")
    async def list_files(request: Request):
        purpose = request.query_params.get("purpose")
        items = store.list(request_owner(request, keyed), purpose)
        return list_page(items, request.query_params, default_limit=MAX_LIST, max_limit=MAX_LIST)

    @app.get("/v1/files/{file_id}")
    async def retrieve(file_id: str, request: Request):
        obj = store.get(file_id, request_owner(request, keyed))
        if obj is None:
            raise not_found(file_id)
        return obj

    @app.get("/v1/files/{file_id}/content")
    async def content(file_id: str, request: Request):
        obj = store.get(file_id, request_owner(request, keyed))
        if obj is None:
            raise not_found(file_id)
        return FileResponse(store.path(file_id), media_type="application/octet-stream", filename=obj["filename"])

    @app.delete("/v1/files/{file_id}")
    async def delete(file_id: str, request: Request):
        if not store.delete(file_id, request_owner(request, keyed)):
            raise not_found(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
