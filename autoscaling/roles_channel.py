"""Where the autoscaler's role assignment travels to the engine replicas: Ray's internal KV (GCS).

The policy runs in the Serve controller and cannot call replicas; every replica can read the
GCS. One key per deployment holds the ids not active (standby, retiring); a replica not named
is active. The policy writes only when the assignment changes; replicas poll.
"""

from __future__ import annotations

import json

from kvtide.autoscaling.standby import Roles

NAMESPACE = "kvtide"


def roles_key(app_name: str, deployment_name: str) -> bytes:
    return f"roles/{app_name}/{deployment_name}".encode()


def encode(roles: Roles) -> bytes:
    return json.dumps({"standby": sorted(roles.standby), "retiring": sorted(roles.retiring)}).encode()


def decode(document: bytes | None) -> dict[str, set[str]]:
    """{"standby": ids, "retiring": ids} of a published document (both empty when none is published)."""
    data = json.loads(document) if document else {}
    return {"standby": set(data.get("standby", ())), "retiring": set(data.get("retiring", ()))}


def role_of(document: bytes | None, replica_id: str) -> str:
    """This replica's role in a published document ("active" when none is published or it is not named)."""
    kept_aside = decode(document)
    if replica_id in kept_aside["retiring"]:
        return "retiring"
    if replica_id in kept_aside["standby"]:
        return "standby"
    return "active"


def publish(app_name: str, deployment_name: str, document: bytes) -> bool:
    """Write the document; False outside a Ray worker (a policy driven by hand, in unit tests)."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return False
    internal_kv._internal_kv_put(roles_key(app_name, deployment_name), document, overwrite=True, namespace=NAMESPACE)
    return True


def read(app_name: str, deployment_name: str) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(roles_key(app_name, deployment_name), namespace=NAMESPACE)
