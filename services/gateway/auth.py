"""API keys on the gateway's HTTP API (docs/security.md).

Keys come from --api-key KEY (repeatable), --api-key-file FILE (one key a line; blank lines and lines starting
with # are skipped) and the SPLITGEMMA_API_KEYS variable (comma-separated), all together. With at least one key,
every request but /health, /ready (probes) and /metrics (unless --metrics-auth) needs `Authorization: Bearer <key>`
or `x-api-key: <key>` (as Anthropic's clients send it) matching one of them, else 401 in OpenAI's error envelope
(Anthropic's under /v1/messages); OpenAI's own answers are matched: no key gives code null, a wrong one code
"invalid_api_key", both of type invalid_request_error (the openai client raises AuthenticationError for either).
With no key the API is open, as before, and a gateway listening beyond loopback says so in its log at start.

vLLM's VLLM_API_KEY is not read: a variable meant for another server, inherited from a shell or an orchestrator's
environment, would silently lock this one (or, emptied, open it).
"""

from __future__ import annotations

import ipaddress
import logging
import os

from starlette.requests import Request
from starlette.responses import JSONResponse

from splitgemma.serving.credentials import CredentialError, bearer_matches, bearer_token, check_token_text, \
    read_secret_file, token_digest

from .messages import error_body, is_messages_path
from .protocol import ApiError

log = logging.getLogger("splitgemma.gateway")

API_KEYS_ENV = "SPLITGEMMA_API_KEYS"
OPEN_PATHS = frozenset({"/health", "/ready"})
OWNER_STATE = "api_key_owner"   # the request state's entry: the matched key's digest (hex)


def load_api_keys(keys: list[str] | None, files: list[str] | None, environ: dict[str, str] | None = None) \
        -> list[str]:
    """Every key of --api-key, --api-key-file and SPLITGEMMA_API_KEYS (duplicates once), or CredentialError naming
    the option, file line or variable of a key that cannot travel in an Authorization header."""
    env = os.environ if environ is None else environ
    found: list[tuple[str, str]] = [(k.strip(), "--api-key") for k in keys or ()]
    for path in files or ():
        try:
            text = read_secret_file(path, "--api-key-file").decode("utf-8")
        except UnicodeDecodeError:
            raise CredentialError(f"--api-key-file {path}: not UTF-8 text") from None
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                found.append((line, f"--api-key-file {path} line {n}"))
    for i, item in enumerate(env.get(API_KEYS_ENV, "").split(","), 1):
        if item.strip():
            found.append((item.strip(), f"{API_KEYS_ENV} item {i}"))
    out: list[str] = []
    for key, source in found:
        check_token_text(key, source)
        if key not in out:
            out.append(key)
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost, or "" (every interface)


def warn_if_open(host: str, keys: list[str]) -> None:
    if not keys and not is_loopback(host):
        log.warning("no API key configured and listening on %s: anyone who can reach this port can use the API "
                    "(set --api-key-file or %s; docs/security.md)", host or "every interface", API_KEYS_ENV,
                    extra={"host": host})


def _refusal(given: bool, path: str) -> JSONResponse:
    if not given:
        err = ApiError(401, "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
                            "(Authorization: Bearer YOUR_KEY), or in an x-api-key header.")
    else:  # never echoed, not even in part: the body may end up in a log
        err = ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    body = error_body(err) if is_messages_path(path) else err.body()
    # RFC 9110 §11.6.1: a 401 names the scheme the client should use.
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def request_owner(request: Request, keyed: bool) -> str:
    """Whose stored objects a request may see: the digest of the API key it was let in with when keys are
    configured, else everyone's ("")."""
    return getattr(request.state, OWNER_STATE, "") if keyed else ""


class ApiKeyMiddleware:
    """ASGI middleware: the key check above, before any route runs (so an unknown path without a key is a 401, not
    a map of which paths exist)."""

    def __init__(self, app, keys: list[str], metrics_auth: bool = False):
        self.app = app
        self.digests = [token_digest(k) for k in keys]
        self.open_paths = OPEN_PATHS if metrics_auth else OPEN_PATHS | {"/metrics"}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.digests or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        api_key = next((v for k, v in scope["headers"] if k == b"x-api-key"), None)
        # Anthropic's clients send the key as x-api-key; either header may carry it. The one that matched names
        # whose stored objects (responses, conversations, files, batches) the request may see: request_owner.
        for value in (header, None if api_key is None else b"Bearer " + api_key):
            if bearer_matches(value, self.digests):
                scope.setdefault("state", {})[OWNER_STATE] = token_digest(bearer_token(value)).hex()
                return await self.app(scope, receive, send)
        await _refusal(header is not None or api_key is not None, scope["path"])(scope, receive, send)
