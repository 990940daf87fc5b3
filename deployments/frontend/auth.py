"""Optional API keys: `Authorization: Bearer <key>`, checked in constant time.

Where keys come from (frontend.auth in the config; the keys themselves never are in it,
because the config is logged and stored in the RayService's serveConfigV2):

    env var  (api_keys_env, default KVTIDE_API_KEYS)  comma-separated entries
    file     (api_keys_file)                          one entry per line, `#` comments;
             the Helm chart mounts the Secret named by apiKeys.existingSecret as this file

An entry is `<key>` or `<tenant> <key>`. A key is a tenant: requests, stored responses and
cached prefixes of one tenant are out of every other's reach (tenancy.py). Keys that name the
same tenant share it; a key that names none is a tenant of its own, called `key-<12 hex of the
key's SHA-256>` (stable, and it reveals nothing usable about the key).

No key found → authentication is off (the local default), unless `require_keys` says a
missing Secret must not open the API. With keys, the API routes (/v1/...) need one;
/health and /ready stay open for probes. A refusal is a 401 whose message never echoes
what the caller sent.

Constant time: a presented key is compared with every configured key through
hmac.compare_digest on SHA-256 digests (equal lengths, so neither the content nor the
length of a key leaks through timing), and the loop never exits early.

Pure logic (no Ray); keys never reach a log line: `ApiKeys.__repr__` shows only a count.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

class AuthConfigError(ValueError):
    """The key sources cannot be read, or none gave a key while keys are required."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


# A tenant name: what a metric label and a keys file can carry.
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def _entry(entry: str) -> tuple[str, str]:
    """(tenant, key) of one keys entry: `<key>` or `<tenant> <key>`."""
    parts = entry.split()
    if len(parts) == 1:
        return f"key-{_digest(parts[0]).hex()[:12]}", parts[0]
    if len(parts) != 2 or not _TENANT_NAME.fullmatch(parts[0]):
        # Never echo the entry: it holds a key.
        raise AuthConfigError("an API key entry must be '<key>' or '<tenant> <key>', the tenant 1-63 letters, "
                              "digits, '.', '_' or '-'; fix the keys file or env var")
    return parts[0], parts[1]


class ApiKeys:
    """The set of accepted keys, held only as SHA-256 digests, each with its tenant."""

    def __init__(self, keys: Iterable[str]):
        entries = dict(_entry(k.strip())[::-1] for k in keys if k and k.strip())  # key -> tenant
        ordered = sorted(entries)
        self._digests = tuple(_digest(k) for k in ordered)
        self._tenants = tuple(entries[k] for k in ordered)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:  # never the keys, not even their digests
        return f"ApiKeys({len(self._digests)} keys)"

    def accepts(self, presented: str) -> bool:
        """Whether `presented` is one of the keys; every key is compared, no early exit."""
        return self.tenant_of(presented) is not None

    def tenant_of(self, presented: str) -> str | None:
        """The tenant of `presented`, None when it is no key; every key is compared, no early exit."""
        candidate = _digest(presented)
        tenant = None
        for digest, name in zip(self._digests, self._tenants):
            if hmac.compare_digest(candidate, digest):
                tenant = name
        return tenant


@dataclass(frozen=True)
class AuthDecision:
    """What to answer: ok (with the key's tenant; None while keys are off), or a 401 with a message
    that never contains the presented key."""

    ok: bool
    message: str = ""
    tenant: str | None = None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def authorize(keys: ApiKeys, authorization: str | None) -> AuthDecision:
    """The decision for one request to a protected route, from its Authorization header."""
    if not keys.enabled:
        return AuthDecision(True)
    token = bearer_token(authorization)
    if token is None:
        return AuthDecision(False, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
    tenant = keys.tenant_of(token)
    if tenant is None:
        return AuthDecision(False, "Incorrect API key provided.")
    return AuthDecision(True, tenant=tenant)


def keys_from_text(text: str) -> list[str]:
    """Entries of a key file: one per line; blank lines and `#` comments skipped."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def load_api_keys(api_keys_env: str | None, api_keys_file: str | None, require_keys: bool,
                  environ: Mapping[str, str]) -> ApiKeys:
    """Keys from the env var and the file together; `environ` is passed in (tests use a dict)."""
    keys: list[str] = []
    if api_keys_env:
        keys += [k.strip() for k in environ.get(api_keys_env, "").split(",") if k.strip()]
    if api_keys_file:
        path = Path(api_keys_file)
        try:
            keys += keys_from_text(path.read_text())
        except OSError as exc:
            raise AuthConfigError(f"frontend.auth.api_keys_file={api_keys_file!r} cannot be read "
                                  f"({type(exc).__name__}); mount the file or set api_keys_file: null") from None
    api_keys = ApiKeys(keys)
    if require_keys and not api_keys.enabled:
        raise AuthConfigError(
            f"frontend.auth.require_keys=true but no API key was found (env {api_keys_env!r}, "
            f"file {api_keys_file!r}); provide keys (Helm: apiKeys.existingSecret) or set require_keys: false")
    return api_keys
