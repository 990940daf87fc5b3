"""Tenants, one per API key (auth.py): what one tenant sends never reaches another's requests,
stored responses or cached prefixes.

    request ids      every id a tenant names or is given for vLLM's layer (X-Request-Id, a body's
                     `request_id`) ends in `.<tag>`, the tenant's tag; an id it names later (an abort's
                     `request_ids`, `previous_response_id`, a stored response's path) is read as
                     `<id>.<tag>` unless it ends so already. Another tenant's id thus names nothing:
                     an abort of it stops nothing, a GET or cancel of it is vLLM's 404 for an unknown id.
    stored responses the id a replica gives a new response ends in the tag too (engine/response_ids.py),
                     and a router pins a request to the replica an id names only for its own tenant.
    cached prefixes  with frontend.auth.tenant_cache_isolation (on by default) the tenant's tag is mixed
                     into `cache_salt`: vLLM keys every KV block of the request by it, so a tenant's
                     requests hit only blocks its own requests computed, and `cached_tokens` or timing
                     tells nothing of another tenant's prompts. Off, tenants share the cache (and can
                     tell each other's recent prefixes), as one tenant's clients always do.

kvtide's own path needs no id scoping: its engine ids are random and never come from the client.
With keys off there are no tenants and nothing is rewritten (vLLM's behaviour exactly).

The tag is not secret: it only has to differ between tenants (12 hex of SHA-256 of the name).
Scoping by suffix is stateless, so every replica and router applies it alike. Pure logic.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Iterable

# The internal header that carries a request's tenant tag to the engine replica's vLLM layer; a
# client's own is dropped (scoped_headers) before the frontend sets it.
TENANT_TAG_HEADER = "x-kvtide-tenant-tag"
_TENANT_TAG_KEY = TENANT_TAG_HEADER.encode("latin-1")
_REQUEST_ID_KEY = b"x-request-id"
TAG_PATTERN = r"[0-9a-f]{12}"
_RESPONSE_PATH = re.compile(r"(/v1/responses/)([^/]+)(/cancel)?")


def tenant_tag(tenant: str | None) -> str | None:
    """The tag scoping `tenant`'s ids and cache; None when there are no tenants (keys off)."""
    if tenant is None:
        return None
    return hashlib.sha256(b"kvtide tenant\0" + tenant.encode("utf-8")).hexdigest()[:12]


def own_id(value: str, tag: str | None) -> str:
    """`value` as the tenant's id: `<value>.<tag>` unless it ends so already (an id the tenant was given)."""
    if tag is None or value.endswith("." + tag):
        return value
    return f"{value}.{tag}"


# vLLM's rules for a cache salt (vllm.entrypoints.generate.base.protocol.validate_cache_salt): kvtide's path
# checks the same (protocol.py), and the salted value must pass them too.
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")


def valid_cache_salt(cache_salt: str) -> bool:
    return 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS and not CACHE_SALT_FORBIDDEN_CHARS & set(cache_salt)


def salted(cache_salt: str | None, tag: str | None, isolate: bool) -> str | None:
    """The cache salt the engine gets: the tenant's tag ahead of the client's salt (a fixed-length prefix, so no
    salt one tenant sends can equal another's), or the client's alone when caches are shared.

    A salt vLLM would refuse is left as sent, to be refused naming the client's own value; one that fits
    alone but not behind the tag is replaced by its SHA-256 (a salt is only ever compared, never read)."""
    if tag is None or not isolate:
        return cache_salt
    if not cache_salt:
        return tag if cache_salt is None else cache_salt
    if not valid_cache_salt(cache_salt):
        return cache_salt
    combined = f"{tag}:{cache_salt}"
    if len(combined) > MAX_CACHE_SALT_CHARS:
        combined = f"{tag}:{hashlib.sha256(cache_salt.encode('utf-8')).hexdigest()}"
    return combined


def is_tenant_salt(cache_salt: str) -> bool:
    """Whether a salt is a tenant's tag alone (`salted` with no client salt): kvtide's own, safe to warm under."""
    return re.fullmatch(TAG_PATTERN, cache_salt) is not None


def scoped_body(data: Any, tag: str | None, isolate: bool) -> dict[str, Any] | None:
    """A body for vLLM's layer with its ids and salt made the tenant's; None when nothing changes."""
    if tag is None or not isinstance(data, dict):
        return None
    scoped = dict(data)
    for field in ("request_id", "previous_response_id"):
        if isinstance(scoped.get(field), str):
            scoped[field] = own_id(scoped[field], tag)
    ids = scoped.get("request_ids")
    if isinstance(ids, str):
        scoped["request_ids"] = own_id(ids, tag)
    elif isinstance(ids, list):
        scoped["request_ids"] = [own_id(i, tag) if isinstance(i, str) else i for i in ids]
    salt = scoped.get("cache_salt")
    if isolate and (salt is None or isinstance(salt, str)):
        scoped["cache_salt"] = salted(salt, tag, isolate)
    return None if scoped == data else scoped


def scoped_body_bytes(body: bytes, data: Any, tag: str | None, isolate: bool) -> bytes:
    """`body` rewritten by scoped_body, or unchanged (the very bytes) when nothing changes."""
    scoped = scoped_body(data, tag, isolate)
    return body if scoped is None else json.dumps(scoped, ensure_ascii=False).encode("utf-8")


def scoped_headers(headers: Iterable[tuple[bytes, bytes]], tag: str | None) -> list[tuple[bytes, bytes]]:
    """ASGI headers for vLLM's layer: a client's tenant-tag header dropped; with a tenant, X-Request-Id made
    its own and the tag header set."""
    out = [(k, v) for k, v in headers if k.lower() != _TENANT_TAG_KEY]
    if tag is None:
        return out
    out = [(k, own_id(v.decode("latin-1"), tag).encode("latin-1")) if k.lower() == _REQUEST_ID_KEY else (k, v)
           for k, v in out]
    return [*out, (_TENANT_TAG_KEY, tag.encode("latin-1"))]


def scoped_path(path: str, tag: str | None) -> str:
    """A stored response's path (`/v1/responses/{id}`, `…/cancel`) with the id made the tenant's."""
    match = _RESPONSE_PATH.fullmatch(path) if tag is not None else None
    if match is None:
        return path
    return f"{match.group(1)}{own_id(match.group(2), tag)}{match.group(3) or ''}"


def tag_of_scope(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The tenant tag the frontend set on a request for vLLM's layer (TENANT_TAG_HEADER), if any."""
    value = next((v.decode("latin-1") for k, v in headers if k.lower() == _TENANT_TAG_KEY), None)
    return value if value is not None and re.fullmatch(TAG_PATTERN, value) else None


def with_tenant_salt(data: Any, tag: str | None, isolate: bool) -> Any:
    """A parsed body for kvtide's own path with its cache salt made the tenant's (a salt of another type is left
    for validation to refuse)."""
    if tag is None or not isolate or not isinstance(data, dict):
        return data
    salt = data.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return data
    return {**data, "cache_salt": salted(salt, tag, isolate)}


# Where the key check leaves a request's tenant: the ASGI scope's `state` (Starlette's `request.state`).
_STATE_KEY = "kvtide_tenant"


def set_request_tenant(scope: dict[str, Any], tenant: str | None) -> None:
    scope.setdefault("state", {})[_STATE_KEY] = tenant


def request_tenant(request: Any) -> str | None:
    """The tenant whose key a request carried (auth.py), None while keys are off."""
    state = getattr(request, "scope", {}).get("state") or {}
    return state.get(_STATE_KEY)
