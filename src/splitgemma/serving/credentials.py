"""The credentials between the gateway and its workers (docs/security.md): a shared service token sent as
`authorization: Bearer <token>` gRPC metadata on every call and checked by a server interceptor on the workers, and
optional TLS / mTLS on the worker ports.

The token comes from --service-token-file FILE or the SPLITGEMMA_SERVICE_TOKEN variable (never a command-line
value, which `ps` shows to every user). With no token configured a worker accepts every caller and the gateway
sends nothing: the behaviour before credentials existed. With one, a worker answers UNAUTHENTICATED to any call
without it, except grpc.health.v1 (probes, e.g. compose's healthcheck or a kubelet's gRPC probe, cannot send
metadata, and health says nothing but SERVING or not). Server reflection needs the token: it maps the API for
whoever asks.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import ssl
from dataclasses import dataclass

from .files import FileTooLarge, NotRegularFile, read_regular

SERVICE_TOKEN_ENV = "SPLITGEMMA_SERVICE_TOKEN"
MIN_TOKEN_CHARS = 16           # a token_urlsafe(12); `up` makes 32 random bytes (43 characters)
MAX_SECRET_FILE_BYTES = 1 << 20
# Methods a worker serves without the token.
OPEN_METHODS_PREFIX = "/grpc.health.v1.Health/"


class CredentialError(ValueError):
    """A credential file or value is unusable: the message names the file or variable (never the secret)."""


def read_secret_file(path: str, what: str) -> bytes:
    """The bytes of a small regular file holding a secret: a FIFO or a device given by mistake is refused instead of
    hanging the process in open() or read() (splitgemma.serving.files)."""
    try:
        return read_regular(path, MAX_SECRET_FILE_BYTES)
    except NotRegularFile:
        raise CredentialError(f"{what} {path}: not a regular file") from None
    except FileTooLarge as e:
        raise CredentialError(f"{what} {path}: {e.size} bytes; a credential file holds at most "
                              f"{MAX_SECRET_FILE_BYTES}") from None
    except OSError as e:
        raise CredentialError(f"{what} {path}: {e.strerror}") from None


def check_token_text(token: str, source: str) -> str:
    """A bearer token as HTTP headers and gRPC metadata carry it: visible ASCII, no spaces. Errors name `source`
    (a file and line, or a variable), never the value."""
    if not token:
        raise CredentialError(f"{source}: the value is empty")
    if not all("\x21" <= c <= "\x7e" for c in token):
        raise CredentialError(f"{source}: only visible ASCII characters (no spaces or control characters) can be "
                              "sent as a bearer token")
    return token


def load_service_token(path: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The service token from `path` (surrounding whitespace stripped), else from SPLITGEMMA_SERVICE_TOKEN, else
    None (no credential: open, as before)."""
    env = os.environ if environ is None else environ
    if path is not None:
        raw = read_secret_file(path, "--service-token-file")
        try:
            token, source = raw.decode("ascii").strip(), f"--service-token-file {path}"
        except UnicodeDecodeError:
            raise CredentialError(f"--service-token-file {path}: not ASCII text") from None
    elif env.get(SERVICE_TOKEN_ENV):
        token, source = env[SERVICE_TOKEN_ENV].strip(), SERVICE_TOKEN_ENV
    else:
        return None
    check_token_text(token, source)
    if len(token) < MIN_TOKEN_CHARS:
        raise CredentialError(f"{source}: the service token has {len(token)} characters; use at least "
                              f"{MIN_TOKEN_CHARS} random ones, e.g. python -c 'import secrets; "
                              "print(secrets.token_urlsafe(32))'")
    return token


def token_digest(token: str | bytes) -> bytes:
    # Comparing digests makes the comparison's time independent of the presented value's length too.
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def bearer_token(header: str | bytes | None) -> str | None:
    """The token t of an `authorization` value "Bearer <t>" (scheme case-insensitive, RFC 6750), else None."""
    if header is None:
        return None
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def bearer_matches(header: str | bytes | None, digests: list[bytes]) -> bool:
    """Whether an `authorization` value is "Bearer <t>" with t one of the tokens whose sha256 is in `digests`; every
    digest is compared, in constant time."""
    token = bearer_token(header)
    if token is None:
        return False
    given = token_digest(token.encode("latin-1"))
    ok = False
    for d in digests:
        ok |= hmac.compare_digest(given, d)
    return ok


# ---------------------------------------------------------------------------------------------------------------
# gRPC: the workers' interceptor, the gateway's


def server_interceptors(token: str | None) -> list:
    """[an interceptor refusing calls without `token`], or [] when there is none."""
    if token is None:
        return []
    import grpc

    digests = [token_digest(token)]

    class _RequireServiceToken(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            handler = await continuation(details)
            if details.method.startswith(OPEN_METHODS_PREFIX):
                return handler
            header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
            if bearer_matches(header, digests):
                return handler
            # Unknown methods too: without the token, UNIMPLEMENTED would tell which methods exist.
            return _refusal_like(handler, "missing" if header is None else "wrong")

    return [_RequireServiceToken()]


def _refusal_like(handler, why: str):
    """A handler of the same call shape as `handler` (unary for an unknown method, None) that answers
    UNAUTHENTICATED without reading the request."""
    import grpc

    message = (f"{why} service credential: this worker requires 'authorization: Bearer <token>' metadata with its "
               f"service token ({SERVICE_TOKEN_ENV} or --service-token-file)")

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    shape = (handler.request_streaming, handler.response_streaming)
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[shape](refuse, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


def client_interceptors(token: str | None) -> list:
    """[an interceptor adding `authorization: Bearer <token>` to every call, of every shape], or [] without one."""
    if token is None:
        return []
    import grpc

    header = ("authorization", f"Bearer {token}")

    def with_token(details):
        metadata = grpc.aio.Metadata(*(details.metadata or ()), header)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)

    # One instance per call shape: a grpc.aio channel files each interceptor under the first shape it implements.
    class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(with_token(details), request)

    class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(with_token(details), request)

    class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, details, request_iterator):
            return await continuation(with_token(details), request_iterator)

    class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, details, request_iterator):
            return await continuation(with_token(details), request_iterator)

    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]


# ---------------------------------------------------------------------------------------------------------------
# TLS


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: this side's certificate chain and key (both or neither) and the CA that verifies the peer."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    option: str = "--tls"   # how the options are spelled, for errors: --tls or --worker-tls

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    def check(self, *, server: bool) -> None:
        """Each file readable and what it claims (with the ssl module's own parser: a key matches its certificate,
        a CA file holds certificates), or CredentialError naming the option."""
        if bool(self.cert) != bool(self.key):
            raise CredentialError(f"{self.option}-cert and {self.option}-key go together (the certificate and its "
                                  "private key)")
        if server and not self.cert:
            raise CredentialError(f"a TLS server needs {self.option}-cert and {self.option}-key ({self.option}-ca "
                                  "alone only says which client certificates to accept)")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path:
                read_secret_file(path, f"{self.option}-{name}")  # regular and small: load_* below would block on a FIFO
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        if self.cert:
            try:
                ctx.load_cert_chain(self.cert, self.key)
            except ssl.SSLError as e:
                raise CredentialError(f"{self.option}-cert {self.cert} / {self.option}-key {self.key}: not a PEM "
                                      f"certificate chain and its matching private key ({e.reason or e})") from None
        if self.ca:
            try:
                ctx.load_verify_locations(cafile=self.ca)
            except ssl.SSLError as e:
                raise CredentialError(f"{self.option}-ca {self.ca}: not PEM CA certificates ({e.reason or e})") \
                    from None

    def _read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        return read_secret_file(path, f"{self.option}-{name}") if path else None

    def server_credentials(self):
        """grpc.ssl_server_credentials: this certificate; with a CA, clients must present a certificate it signed."""
        import grpc
        self.check(server=True)
        ca = self._read("ca")
        return grpc.ssl_server_credentials([(self._read("key"), self._read("cert"))], root_certificates=ca,
                                           require_client_auth=ca is not None)

    def channel_credentials(self):
        """grpc.ssl_channel_credentials: verify the server with the CA (the system's roots without one), present
        this certificate if given (mTLS)."""
        import grpc
        self.check(server=False)
        return grpc.ssl_channel_credentials(root_certificates=self._read("ca"), private_key=self._read("key"),
                                            certificate_chain=self._read("cert"))


def add_service_token_option(p: argparse.ArgumentParser) -> None:
    """--service-token-file, of both workers and the gateway."""
    p.add_argument("--service-token-file", metavar="FILE",
                   help="the shared service token (one line) the gateway sends and the workers require on every "
                        f"gRPC call but health checks (default: the {SERVICE_TOKEN_ENV} variable; neither = no "
                        "credential, as on a trusted loopback; docs/security.md)")


def add_tls_options(p: argparse.ArgumentParser, prefix: str, cert_help: str, ca_help: str | None) -> None:
    """{prefix}-cert, {prefix}-key and (with ca_help) {prefix}-ca: PEM files."""
    p.add_argument(f"{prefix}-cert", metavar="PEM", help=cert_help)
    p.add_argument(f"{prefix}-key", metavar="PEM", help=f"the private key of {prefix}-cert")
    if ca_help is not None:
        p.add_argument(f"{prefix}-ca", metavar="PEM", help=ca_help)


def tls_files(args, prefix: str) -> TlsFiles:
    """The TlsFiles of parsed options {prefix}-cert/-key/-ca (prefix "tls" or "worker_tls")."""
    return TlsFiles(cert=getattr(args, f"{prefix}_cert"), key=getattr(args, f"{prefix}_key"),
                    ca=getattr(args, f"{prefix}_ca", None), option="--" + prefix.replace("_", "-"))
