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
from typing import BinaryIO

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

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
        for part in self.folder.glob("*.part"):   # an upload or a record cut short by a stop: never answered for
            part.unlink(missing_ok=True)
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
        """POST /v1/files: the multipart form's `file` (streamed into the folder as it arrives, bounded by the room
        left), `purpose` and `expires_after`."""
        kind, params = parse_options_header(request.headers.get("content-type", ""))
        if kind != b"multipart/form-data" or not params.get(b"boundary"):
            raise invalid("upload the file as multipart/form-data, with fields file and purpose", param="file",
                          code="invalid_value")
        room = max(self._max_bytes - self.used, 0)
        form = _Form(self.scratch(new_id("upload-")), room, self._full_message)
        try:
            parser = MultipartParser(params[b"boundary"], form.callbacks())
            async for chunk in stream_body(request, room + FORM_OVERHEAD, idle_timeout, self._full_message):
                parser.write(chunk)
            parser.finalize()
            if not form.ended:
                raise MultipartParseError("the form ends before its closing boundary")
            if form.filename is None:
                raise invalid("the form has no file field", param="file", code="missing_required_parameter")
            purpose = form.fields.get("purpose")
            if purpose not in PURPOSES:
                raise invalid(f"purpose must be one of {', '.join(PURPOSES)} here (the files this server reads are "
                              f"batches' inputs), not {str(purpose)[:64]!r}", param="purpose", code="invalid_value")
            expires_at = self._expiry(form.fields)
            form.close()
            name = os.path.basename(form.filename) or "upload"
            return self.add(owner, form.path, name[:256], purpose, expires_at)
        except MultipartParseError as e:
            raise invalid(f"the upload is not a well-formed multipart form: {e}", param="file") from None
        finally:
            form.close()
            form.path.unlink(missing_ok=True)   # moved into the store when the upload is good

    def _full_message(self) -> str:
        return (f"the upload does not fit: the gateway's files take {self.used >> 20} MB of the "
                f"{self.limits.megabytes} MB it keeps (--files-mb); delete files you no longer need")

    @staticmethod
    def _expiry(fields: dict[str, str]) -> int | None:
        anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
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


class _Form:
    """python-multipart's callbacks for an upload form: the `file` part's bytes written to `path` as they come (413
    past `room`), the other parts kept as short text fields."""

    MAX_FIELDS, MAX_FIELD_BYTES = 8, 4096

    def __init__(self, path: Path, room: int, full_message):
        self.path, self.room, self.full_message = path, room, full_message
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.size = 0
        self.ended = False
        self._out: BinaryIO | None = None
        self._writing = False
        self._headers: dict[bytes, bytes] = {}
        self._field, self._value = b"", b""
        self._name: str | None = None
        self._data = bytearray()
        self._parts = 0

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
                "on_part_end": self._part_end, "on_end": self._end}

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def _begin(self) -> None:
        self._parts += 1
        if self._parts > self.MAX_FIELDS:
            raise invalid(f"the form has more than {self.MAX_FIELDS} parts", param="file")
        self._headers, self._data, self._writing = {}, bytearray(), False

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = params.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file":
            if self.filename is not None:
                raise invalid("the form has more than one file", param="file")
            self.filename = params.get(b"filename", b"").decode("utf-8", "replace")
            self._out = open(self.path, "wb")
            self._writing = True

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._writing:
            self.size += end - start
            if self.size > self.room:
                raise ApiError(413, self.full_message(), code="request_too_large")
            self._out.write(data[start:end])
        else:
            self._data += data[start:end]
            if len(self._data) > self.MAX_FIELD_BYTES:
                raise invalid(f"the form's field {self._name[:64]!r} is longer than {self.MAX_FIELD_BYTES} bytes",
                              param=self._name[:64] or None)

    def _part_end(self) -> None:
        if self._writing:
            self.close()
            self._writing = False
        elif self._name:
            self.fields[self._name] = self._data.decode("utf-8", "replace")

    def _end(self) -> None:
        self.ended = True


def add_file_endpoints(app: FastAPI, store: FileStore, keyed: bool, idle_timeout: float) -> None:
    @app.post("/v1/files")
    async def upload(request: Request):
        return await store.upload(request, request_owner(request, keyed), idle_timeout)

    @app.get("/v1/files")
    async def list_files(request: Request):
        purpose = request.query_params.get("purpose")
        items = store.list(request_owner(request, keyed), purpose)
        return list_page(items, request.query_params, default_limit=MAX_LIST, max_limit=MAX_LIST)

    def owned(request: Request, file_id: str) -> dict:
        obj = store.get(file_id, request_owner(request, keyed))
        if obj is None:
            raise not_found(file_id)
        return obj

    @app.get("/v1/files/{file_id}")
    async def retrieve(file_id: str, request: Request):
        return owned(request, file_id)

    @app.get("/v1/files/{file_id}/content")
    async def content(file_id: str, request: Request):
        obj = owned(request, file_id)
        return FileResponse(store.path(file_id), media_type="application/octet-stream", filename=obj["filename"])

    @app.delete("/v1/files/{file_id}")
    async def delete(file_id: str, request: Request):
        if not store.delete(file_id, request_owner(request, keyed)):
            raise not_found(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
