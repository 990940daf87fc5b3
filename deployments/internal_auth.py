"""Authenticated internal hops: HAProxy → routing peer → HAProxy → engine replica.

Direct mode has two hops a client must not be able to stand in for:

    HAProxy ──POST /internal/route + x-kvtide-consult: <consult token>──► routing peer
    routing peer ──{replica, router headers + x-serve-router-kvtide-signature}──► HAProxy
    HAProxy ──the client's request + the router headers──► engine replica's own port

The routing peer answers a consult only with the consult token, so nobody but the node's
HAProxy learns a pick, books load or feeds the hot-prefix list. The router headers (token
ids, block hashes, the router's prediction) are trusted by a replica only under a valid
signature: an HMAC over the headers and the body the peer saw, so headers sent straight to
a replica's port, or lifted from one request onto another body, are ignored (the replica
tokenizes itself). HAProxy also strips the `x-serve-router-` namespace from clients.

Both derive from one cluster secret, read from the file named by `KVTIDE_INTERNAL_SECRET_FILE`
(the Helm chart mounts it from a Secret; `kvtide serve` writes a fresh one per cluster, mode
0600). No secret, no trust: the routing peer refuses to start, and a replica never accepts
router headers. Pure logic (no Ray).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Callable, Mapping

SECRET_FILE_ENV = "KVTIDE_INTERNAL_SECRET_FILE"
CONSULT_HEADER = "x-kvtide-consult"
ROUTE_SIGNATURE_HEADER = "x-serve-router-kvtide-signature"
# Shorter secrets are refused: the HMACs are only as strong as the secret.
MIN_SECRET_BYTES = 32


class InternalAuthError(ValueError):
    """The cluster secret is missing, unreadable or too short."""


def load_internal_secret(environ: Mapping[str, str]) -> bytes:
    """The cluster secret, from the file `environ[SECRET_FILE_ENV]` names (surrounding whitespace dropped)."""
    path = environ.get(SECRET_FILE_ENV)
    if not path:
        raise InternalAuthError(
            f"{SECRET_FILE_ENV} is not set: direct mode authenticates HAProxy's consults and the routing peer's "
            "headers with a cluster secret; `kvtide serve` and the Helm chart provide one, a hand-made Ray "
            f"cluster must set {SECRET_FILE_ENV} on every node to a file holding at least {MIN_SECRET_BYTES} "
            "random bytes (e.g. `openssl rand -hex 32`)")
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise InternalAuthError(f"{SECRET_FILE_ENV}={path!r} cannot be read ({type(exc).__name__})") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise InternalAuthError(f"the cluster secret in {path!r} has {len(secret)} bytes; it needs at least "
                                f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
    return secret


def consult_token(secret: bytes) -> str:
    """What HAProxy sends the routing peer in CONSULT_HEADER (derived, so the secret itself never travels)."""
    return hmac.new(secret, b"kvtide consult v1", hashlib.sha256).hexdigest()


def consult_allowed(secret: bytes, presented: str | None) -> bool:
    """Whether a consult carries the token, compared in constant time."""
    return presented is not None and hmac.compare_digest(consult_token(secret).encode(), presented.encode("latin-1"))


def _route_mac(secret: bytes, body_seen: bytes, headers: Mapping[str, str]) -> str:
    mac = hmac.new(secret, b"kvtide route v1\0", hashlib.sha256)
    mac.update(len(body_seen).to_bytes(8, "big"))
    mac.update(hashlib.sha256(body_seen).digest())
    for name in sorted(headers):
        mac.update(name.lower().encode("latin-1") + b"\0" + headers[name].encode("latin-1") + b"\0")
    return mac.hexdigest()


def sign_route(secret: bytes, body_seen: bytes, headers: Mapping[str, str]) -> dict[str, str]:
    """`headers` with their signature: bound to every header and to the body the peer saw (HAProxy may have
    cut it at its buffer: the length says how much of the replica's body it covers)."""
    if not headers:
        return {}
    return {**headers, ROUTE_SIGNATURE_HEADER: f"{len(body_seen)}.{_route_mac(secret, body_seen, headers)}"}


def verified_route_headers(secret: bytes | None, body: bytes, names: tuple[str, ...],
                           get: Callable[[str], str | None]) -> dict[str, str]:
    """The router headers among `names` (read with `get`) when their signature holds for `body`, else {}."""
    signature = get(ROUTE_SIGNATURE_HEADER)
    if secret is None or not signature:
        return {}
    length, _, mac = signature.partition(".")
    if not length.isdigit() or int(length) > len(body):
        return {}
    headers = {name: value for name in names if (value := get(name)) is not None}
    expected = _route_mac(secret, body[:int(length)], headers)
    return headers if hmac.compare_digest(expected.encode(), mac.encode("latin-1")) else {}
