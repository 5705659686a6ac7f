"""Who may call a worker and how the bytes travel: the shared token, TLS and mutual TLS, run ownership.

Both commands take the same settings (``--token`` / ``--token-file`` / ``GRADWIRE_TOKEN``, TLS files).
The coordinator's ``ClientSecurity`` makes the channel and the metadata every call carries; the worker's
``ServerSecurity`` makes the server credentials, and ``gradwire.interceptors.RequireToken`` checks the
token in front of every method but the health service.

Runs are isolated from each other by *ownership*: the coordinator sends a random per-run key with every
call (``gradwire-run-key``), and the worker binds a run to the digest of that key and of the caller's TLS
client certificate, if any (``run_owner``), when the run's first state arrives. A caller that presents
another digest can neither read nor replace that run, and Describe lists only the caller's own runs. The
token keeps strangers out; the run key keeps one holder of the token out of another's run. ``coordinator
train`` keeps its run's key in the run's checkpoint directory (``run.key``, readable by its owner alone), so
that the same command restarted on the run is the same owner to the workers that kept its sessions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

TOKEN_ENV = "GRADWIRE_TOKEN"
AUTH_HEADER = "authorization"
RUN_KEY_HEADER = "gradwire-run-key"
BEARER = "Bearer "
MAX_TOKEN_CHARS = 4096
MIN_TOKEN_CHARS = 16  # shorter tokens work, with a warning: they can be guessed
RUN_KEY_BYTES = 32
_LOOPBACK_NAMES = {"localhost", "ip6-localhost", "ip6-loopback"}


# ------------------------------------------------------------------------------------------- tokens


def check_token(token: str, source: str) -> str:
    """``token`` if it can travel as gRPC metadata (printable ASCII, no spaces); ``ValueError`` naming
    ``source`` (the flag, file or variable it came from) otherwise."""
    if not token:
        raise ValueError(f"{source}: the token is empty")
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(f"{source}: the token is longer than {MAX_TOKEN_CHARS} characters")
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(f"{source}: the token must be printable ASCII without spaces")
    if len(token) < MIN_TOKEN_CHARS:
        log.warning(
            "%s: the token has only %d characters; use %d or more random ones (openssl rand -hex 32)",
            source,
            len(token),
            MIN_TOKEN_CHARS,
        )
    return token


def resolve_token(
    token: str | None = None, token_file: str | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The shared token: ``--token``, else the first line of ``--token-file``, else ``$GRADWIRE_TOKEN``,
    else ``None`` (no authentication). ``ValueError`` naming the source if it is unusable."""
    if token is not None and token_file is not None:
        raise ValueError("give --token or --token-file, not both")
    if token is not None:
        return check_token(token, "--token")
    if token_file is not None:
        try:
            text = Path(token_file).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--token-file {token_file}: cannot read it ({e})") from None
        return check_token(text.strip().splitlines()[0] if text.strip() else "", f"--token-file {token_file}")
    value = (os.environ if environ is None else environ).get(TOKEN_ENV)
    return check_token(value, f"${TOKEN_ENV}") if value else None


def token_matches(presented: str | None, expected: str) -> bool:
    """Constant-time comparison (of digests, so that not even the length leaks)."""
    if presented is None:
        return False
    return hmac.compare_digest(hashlib.sha256(presented.encode()).digest(), hashlib.sha256(expected.encode()).digest())


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` header, if the call carries one."""
    for key, value in metadata or ():
        if key == AUTH_HEADER and isinstance(value, str) and value.startswith(BEARER):
            return value[len(BEARER) :]
    return None


# ------------------------------------------------------------------------------------------- TLS


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerSecurity:
    """A worker's side: the token callers must present, and its TLS files (PEM).

    ``tls_client_ca`` turns on mutual TLS: only clients with a certificate signed by that CA connect.
    """

    token: str | None = dataclasses.field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def credentials(self) -> grpc.ServerCredentials | None:
        """Server credentials for TLS (``None``: plaintext). ``ValueError`` naming an unreadable file."""
        if not self.tls:
            return None
        key, cert = _read(self.tls_key, "--tls-key"), _read(self.tls_cert, "--tls-cert")
        ca = _read(self.tls_client_ca, "--tls-client-ca")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def warnings(self, host: str) -> list[str]:
        """What is unsafe about serving on ``host`` with these settings (empty when nothing is)."""
        if is_loopback(host):
            return []
        out = []
        if self.token is None:
            out.append(
                f"listening on {host} beyond loopback WITHOUT A TOKEN: anyone who reaches this port can make this "
                f"worker compute and read or replace its runs. Set --token-file or ${TOKEN_ENV} (and TLS), or --host "
                "127.0.0.1"
            )
        elif not self.tls:
            out.append(
                f"listening on {host} with a token but without TLS: the token crosses the network in the clear "
                "(--tls-cert/--tls-key)"
            )
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientSecurity:
    """A coordinator's side: the token, TLS trust (``tls_ca``: the CA that signed the workers'
    certificates; the system's roots if omitted), an optional client certificate for mutual TLS, and this
    run's key (random per run; ``coordinator train`` keeps it with the run's checkpoints, mode 0600)."""

    token: str | None = dataclasses.field(default=None, repr=False)
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None  # the name to expect in the workers' certificates, if not their host
    run_key: bytes = dataclasses.field(default_factory=lambda: secrets.token_bytes(RUN_KEY_BYTES), repr=False)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if (self.tls_ca or self.tls_cert or self.tls_server_name) and not self.tls:
            object.__setattr__(self, "tls", True)  # any TLS file means TLS
        if len(self.run_key) < 16:
            raise ValueError("the run key must be at least 16 bytes")

    def metadata(self, run_key: bool = True) -> tuple[tuple[str, str], ...]:
        """What every call carries: the token, if any, and the run key (not on calls that belong to no run,
        as a worker's Join and Tunnel to a coordinator)."""
        md = [(RUN_KEY_HEADER, self.run_key.hex())] if run_key else []
        if self.token is not None:
            md.append((AUTH_HEADER, BEARER + self.token))
        return tuple(md)

    def channel(self, address: str, options: Sequence[tuple[str, object]]) -> grpc.Channel:
        """A channel to ``address``: TLS when configured, else plaintext. ``ValueError`` naming a bad file."""
        if not self.tls:
            return grpc.insecure_channel(address, options=list(options))
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "--tls-ca"),
            private_key=_read(self.tls_key, "--tls-key"),
            certificate_chain=_read(self.tls_cert, "--tls-cert"),
        )
        extra = [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name else []
        return grpc.secure_channel(address, creds, options=[*options, *extra])


# ------------------------------------------------------------------------------------------- ownership


def run_key(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes:
    """The run key a call carries (hex in metadata); empty if none or malformed."""
    for key, value in metadata or ():
        if key == RUN_KEY_HEADER and isinstance(value, str) and len(value) <= 2 * 1024:
            try:
                return bytes.fromhex(value)
            except ValueError:
                return b""
    return b""


def peer_certificate(context: grpc.ServicerContext) -> bytes:
    """The caller's TLS client certificate (PEM), if it presented one (mutual TLS); else empty."""
    try:
        certs = context.auth_context().get("x509_pem_cert") or []
    except Exception:  # noqa: BLE001 - an insecure call has no auth context worth reading
        return b""
    return certs[0] if certs else b""


def run_owner(certificate: bytes, key: bytes) -> bytes:
    """Who a run belongs to: a digest of the caller's client certificate (if any) and its run key."""
    h = hashlib.sha256(b"gradwire-run-owner\0")
    h.update(len(certificate).to_bytes(8, "big") + certificate)
    h.update(key)
    return h.digest()


def caller(context: grpc.ServicerContext) -> bytes:
    """The owner digest of the call behind ``context``."""
    return run_owner(peer_certificate(context), run_key(context.invocation_metadata()))


def same_owner(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


# ------------------------------------------------------------------------------------------- addresses


def is_loopback(host: str) -> bool:
    """Whether a listening address is reachable from this machine only."""
    name = host.strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name, or "" / "::" / "0.0.0.0" (every interface: not loopback)
