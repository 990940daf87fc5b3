"""Generate helm/kvtide/values.schema.json from the config model plus the chart's own keys.

    python helm/generate_schema.py           # rewrite the committed schema
    python helm/generate_schema.py --check   # exit 1 if the committed schema is stale

Why generated: the `kvtide:` key of the chart values IS a kvtide config (it becomes the
serveConfigV2 `args`), so its schema must follow `kvtide.config.KvtideConfig` exactly;
a hand copy would drift the first time a later issue adds a field. The chart-level keys
(image, worker groups, monitoring, ...) have no Python model, so they are written here.

Helm 4 validates values with a JSON-schema 2020-12 validator at install/upgrade/template/
lint time, so a typo or an unknown routing policy fails before anything reaches the
cluster. Cross-field rules JSON schema cannot say (gpusPerPod a multiple of TP, min <=
max replicas) are `fail` calls in templates/_helpers.tpl.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvtide.config import KvtideConfig
from kvtide.config.model import RENAMED_SECTIONS

SCHEMA_PATH = Path(__file__).resolve().parent / "kvtide" / "values.schema.json"
REGENERATE_HINT = "python helm/generate_schema.py"

Schema = dict[str, Any]


# --- the kvtide key: from the pydantic model ---------------------------------------------


def _inline_refs(node: Any, defs: dict[str, Schema]) -> Any:
    """Replace every `{"$ref": "#/$defs/X"}` with a copy of X, and drop pydantic's titles.

    Inlined because the model's $defs would have to live at the document root, next to
    the chart's own keys, where a later model class could collide with a chart name; an
    inlined tree also reads top-down in an editor. The model has no recursive types.
    """
    if isinstance(node, list):
        return [_inline_refs(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    out: Schema = {}
    ref = node.get("$ref")
    if isinstance(ref, str):
        name = ref.removeprefix("#/$defs/")
        out.update(_inline_refs(defs[name], defs))
    for key, value in node.items():
        if key in ("$ref", "$defs"):
            continue
        # "title" is a schema keyword only when its value is a string; a property *named*
        # title would hold a dict and is kept.
        if key == "title" and isinstance(value, str):
            continue
        out[key] = _inline_refs(value, defs)
    return out


def kvtide_schema() -> Schema:
    """The KvtideConfig model's JSON schema, self-contained."""
    raw = KvtideConfig.model_json_schema()
    schema = _inline_refs(raw, raw.get("$defs", {}))
    # A renamed section is still accepted (the app reads it as its new name, with a warning).
    for old, new in RENAMED_SECTIONS.items():
        schema["properties"][old] = {**schema["properties"][new],
                                     "description": f"Deprecated: the old name of `{new}`, read as `{new}`."}
    schema["description"] = (
        "The kvtide cluster config (config/ KvtideConfig); rendered verbatim as the "
        "serveConfigV2 application args. " + schema.get("description", "")
    ).strip()
    return schema


# --- chart-level keys: hand-written ------------------------------------------------------


def _obj(properties: dict[str, Schema], description: str = "", *, required: tuple[str, ...] = ()) -> Schema:
    """A closed object: unknown keys are typos, and Helm should say so."""
    schema: Schema = {"type": "object", "additionalProperties": False, "properties": properties}
    if description:
        schema["description"] = description
    if required:
        schema["required"] = list(required)
    return schema


def _str(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def _bool(description: str) -> Schema:
    return {"type": "boolean", "description": description}


def _int(description: str, minimum: int = 0, nullable: bool = False) -> Schema:
    schema: Schema = {"type": ["integer", "null"] if nullable else "integer", "description": description}
    schema["minimum"] = minimum
    return schema


def _map(description: str) -> Schema:
    """A string-to-string map (labels, annotations, nodeSelector)."""
    return {"type": "object", "additionalProperties": {"type": "string"}, "description": description}


def _k8s(description: str, kind: str = "object") -> Schema:
    """A Kubernetes object passed through as is; the API server validates its inside."""
    return {"type": kind, "description": description}


def _resources(description: str) -> Schema:
    quantity = {"type": ["string", "number"]}
    return _obj(
        {
            "requests": {"type": "object", "additionalProperties": quantity},
            "limits": {"type": "object", "additionalProperties": quantity},
        },
        description,
    )


def _peers(description: str) -> Schema:
    return {"type": "array", "items": {"type": "object"}, "description": description}


def _worker_group() -> Schema:
    return _obj(
        {
            "name": _str("Ray worker group name (groupName); unique, DNS-label-like.", pattern="^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", maxLength=40),
            "gpusPerPod": _int(
                "GPUs per worker pod; null = kvtide.engine.tensor_parallel_size. Must be a multiple of it.",
                minimum=1,
                nullable=True,
            ),
            "minReplicas": _int("Worker pods kept at least; null = derived from kvtide.replicas.", nullable=True),
            "maxReplicas": _int("Worker pods at most; null = derived from kvtide.replicas.", nullable=True),
            "acceleratorType": _str("Value of the accelerator node label (acceleratorLabelKey); empty = any GPU node."),
            "nodeSelector": _map("Extra node labels the worker pods require."),
            "tolerations": _k8s("Tolerations added to gpuTolerations.", "array"),
            "affinity": _k8s("Pod affinity/anti-affinity of the worker pods."),
            "resources": _resources("CPU/memory per worker pod (default: workerDefaults.resources); nvidia.com/gpu is set from gpusPerPod."),
            "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Extra `ray start` flags."},
            "podLabels": _map("Extra labels on the worker pods."),
            "podAnnotations": _map("Extra annotations on the worker pods."),
        },
        "One GPU worker group (a pool of identical GPU pods).",
        required=("name",),
    )


def chart_properties() -> dict[str, Schema]:
    """Every chart-level key of values.yaml except `kvtide`."""
    return {
        "nameOverride": _str("Replaces the chart name in resource names."),
        "fullnameOverride": _str("Replaces the whole resource name prefix.", maxLength=40),
        "image": _obj(
            {
                "repository": _str("Serving image (built from the repository's Dockerfile).", minLength=1),
                "tag": _str("Image tag; empty = the chart's appVersion."),
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"], "description": "imagePullPolicy."},
            },
            "The kvtide serving image, used by the head and every worker.",
            required=("repository",),
        ),
        "imagePullSecrets": {"type": "array", "items": _obj({"name": _str("Secret name.")}, required=("name",))},
        "upgradeStrategy": _obj(
            {
                "type": {
                    "enum": ["NewCluster", "NewClusterWithIncrementalUpgrade", "None"],
                    "description": "How KubeRay rolls out a changed rayClusterConfig.",
                },
                "clusterUpgradeOptions": _k8s("KubeRay clusterUpgradeOptions (incremental upgrade only)."),
            },
            "RayService spec.upgradeStrategy.",
        ),
        "proxyLocation": {
            "enum": ["EveryNode", "HeadOnly"],
            "description": "Where Ray Serve runs its HTTP proxy (serveConfigV2 proxy_location), and so which pods the Service selects.",
        },
        "head": _obj(
            {
                "runsReplicas": _bool("Let Ray place CPU-using Serve replicas on the head; false = num-cpus 0 on the head."),
                "resources": _resources("CPU/memory of the head pod (no GPUs: Serve controller, proxy, routing peer)."),
                "nodeSelector": _map("Node labels the head pod requires."),
                "tolerations": _k8s("Tolerations of the head pod.", "array"),
                "affinity": _k8s("Affinity of the head pod."),
                "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Extra `ray start` flags."},
                "podLabels": _map("Extra labels on the head pod."),
                "podAnnotations": _map("Extra annotations on the head pod."),
            },
            "The Ray head pod.",
        ),
        "workerGroups": {"type": "array", "minItems": 1, "items": _worker_group(), "description": "GPU worker groups."},
        "workerDefaults": _obj(
            {"resources": _resources("CPU/memory per worker pod for groups that give none.")},
            "Defaults for keys a worker group leaves out (Helm replaces lists wholesale).",
        ),
        "acceleratorLabelKey": _str("Node label that names the GPU model (GPU feature discovery)."),
        "gpuTolerations": _k8s("Tolerations every GPU worker pod gets.", "array"),
        "rayAutoscaler": _obj(
            {
                "idleTimeoutSeconds": _int("Seconds a worker pod idles before the Ray autoscaler removes it."),
                "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"], "description": "Ray autoscaler upscaling mode."},
                "resources": _resources("Resources of the autoscaler sidecar."),
            },
            "Ray's in-tree autoscaler (enabled when kvtide.replicas uses min/max).",
        ),
        "shm": _obj({"sizeLimit": _str("Size of the /dev/shm memory volume (NCCL, vLLM IPC).")}, "/dev/shm."),
        "modelCache": _obj(
            {
                "type": {"enum": ["pvc", "hostPath", "emptyDir"], "description": "Volume kind of the model cache."},
                "mountPath": _str("Where the cache is mounted; HF_HOME points here.", pattern="^/"),
                "compileCaches": _bool("Keep vLLM's torch.compile and Triton's kernel caches on this volume "
                                       "(VLLM_CACHE_ROOT, TRITON_CACHE_DIR)."),
                "pvc": _obj({"claimName": _str("An existing PersistentVolumeClaim (ReadWriteMany when workers span nodes).")}),
                "hostPath": _obj({"path": _str("Directory on the node.", pattern="^/")}),
                "emptyDir": _obj({"sizeLimit": _str("Size limit; empty = none.")}),
            },
            "Where model weights are downloaded and cached.",
        ),
        "hfToken": _obj(
            {
                "secretName": _str("Secret holding the Hugging Face token; empty = no HF_TOKEN."),
                "secretKey": _str("Key inside that Secret."),
            },
            "Hugging Face token for gated models (env HF_TOKEN).",
        ),
        "apiKeys": _obj(
            {
                "existingSecret": _str("Secret holding the key file (one `<key>` or `<tenant> <key>` per line, `#` comments); "
                                       "empty = no keys, which needs kvtide.frontend.auth.require_keys false."),
                "secretKey": _str("Key inside that Secret: the file name under /etc/kvtide/api-keys/.",
                                  pattern="^[-._a-zA-Z0-9]+$"),
            },
            "API keys for the OpenAI endpoint (Authorization: Bearer): the Secret is mounted as a file on every Ray pod "
            "and kvtide.frontend.auth.api_keys_file points at it.",
        ),
        "internalSecret": _obj(
            {
                "existingSecret": _str("Secret with key `secret` (at least 32 random bytes); empty = the chart-generated "
                                       "<fullname>-internal."),
            },
            "The cluster's internal secret (HMAC of the routing headers, HAProxy's consult token), mounted at "
            "/etc/kvtide/internal/secret on every Ray pod.",
        ),
        "rayAuth": _obj(
            {
                "enabled": _bool("Ray token authentication (KubeRay authOptions.mode token); false = mode disabled."),
                "existingSecret": _str("Secret with key `auth_token`; empty = the chart-generated <fullname>-ray-auth."),
            },
            "Ray's token authentication for its RPCs, dashboard and client port.",
        ),
        "serviceAccount": _obj(
            {"annotations": _map("Annotations on the Ray pods' ServiceAccounts.")},
            "The Ray pods' ServiceAccounts (no API token except on the head while Ray's autoscaler runs).",
        ),
        "podSecurityContext": _k8s("Pod securityContext of every Ray pod (restricted Pod Security profile by default)."),
        "securityContext": _k8s("securityContext of every Ray container and the Ray autoscaler sidecar."),
        "homeDir": _str("Home directory of the image's user; its cache/config subdirectories get writable volumes.",
                        pattern="^/"),
        "env": _k8s("Extra env vars for every Ray container.", "array"),
        "envFrom": _k8s("Extra envFrom sources for every Ray container.", "array"),
        "service": _obj(
            {
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"], "description": "Service type."},
                "port": _int("Port of the OpenAI endpoint on the Service.", minimum=1),
                "annotations": _map("Service annotations."),
            },
            "The Service of the OpenAI endpoint (selects the pods whose Serve proxy is healthy).",
        ),
        "ingress": _obj(
            {
                "enabled": _bool("Create an Ingress to the Service."),
                "className": _str("ingressClassName; empty = the cluster default."),
                "annotations": _map("Ingress annotations."),
                "hosts": {
                    "type": "array",
                    "items": _obj(
                        {
                            "host": _str("Host name."),
                            "paths": {
                                "type": "array",
                                "items": _obj(
                                    {
                                        "path": _str("URL path.", pattern="^/"),
                                        "pathType": {"enum": ["Prefix", "Exact", "ImplementationSpecific"]},
                                    },
                                    required=("path",),
                                ),
                            },
                        },
                        required=("host",),
                    ),
                },
                "tls": _k8s("Ingress TLS entries.", "array"),
            },
            "Optional Ingress.",
        ),
        "httpRoute": _obj(
            {
                "enabled": _bool("Create a Gateway API HTTPRoute to the Service."),
                "annotations": _map("HTTPRoute annotations."),
                "parentRefs": {"type": "array", "items": {"type": "object"}, "description": "Gateways to attach to."},
                "hostnames": {"type": "array", "items": {"type": "string"}},
            },
            "Optional Gateway API HTTPRoute.",
        ),
        "monitoring": _obj(
            {
                "labels": _map("Labels on every monitoring object (kube-prometheus-stack selects on `release`)."),
                "podMonitor": _obj(
                    {
                        "enabled": _bool("Create a PodMonitor for the Ray metrics port."),
                        "interval": _str("Scrape interval.", pattern="^[0-9]+(ms|s|m|h)$"),
                    }
                ),
                "prometheusRule": _obj({"enabled": _bool("Create a PrometheusRule from files/alerts.yaml.")}),
                "dashboards": _obj(
                    {
                        "enabled": _bool("Create one ConfigMap per dashboards/*.json for the Grafana sidecar."),
                        "labels": _map("Labels the Grafana sidecar looks for."),
                        "annotations": _map("Annotations (e.g. the sidecar's folder annotation)."),
                    }
                ),
            },
            "Prometheus operator and Grafana objects.",
        ),
        "gcsFaultTolerance": _obj(
            {
                "enabled": _bool("Render rayClusterConfig.gcsFaultToleranceOptions (GCS state in Redis; needs redisAddress)."),
                "redisAddress": _str("host:port of the Redis the GCS persists its state to."),
                "redisPassword": _obj(
                    {
                        "secretName": _str("An existing Secret holding the Redis password; empty = no password."),
                        "secretKey": _str("Key inside that Secret.", minLength=1),
                    }
                ),
                "externalStorageNamespace": _str("Redis key namespace of the GCS state; empty = the RayCluster's UID."),
            },
            "GCS fault tolerance: a head restart keeps the workers and their engines serving.",
        ),
        "podDisruptionBudget": _obj(
            {
                "enabled": _bool("Create PodDisruptionBudgets for the Ray pods."),
                "maxUnavailable": _int("Worker pods a voluntary disruption may take at once.", minimum=1),
                "unhealthyPodEvictionPolicy": {
                    "enum": ["AlwaysAllow", "IfHealthyBudget"],
                    "description": "When pods that are not Ready may be evicted.",
                },
                "head": _obj(
                    {
                        "enabled": {
                            "type": ["boolean", "null"],
                            "description": "A zero budget for the head pod; null = on unless gcsFaultTolerance.enabled.",
                        },
                    }
                ),
            },
            "Voluntary-disruption budgets of the worker pods and the head.",
        ),
        "networkPolicy": _obj(
            {
                "enabled": _bool("Create the NetworkPolicies of the Ray pods."),
                "servePeers": _peers("Who may reach the OpenAI port; empty = anyone."),
                "metricsPeers": _peers("Who may scrape the metrics port; empty = nobody."),
                "kuberayOperatorPeers": _peers("The KubeRay operator's pods: the Ray dashboard (8265) and the serve port."),
                "dashboardPeers": _peers("Who else may reach the Ray dashboard (8265); empty = nobody else."),
                "dnsPeers": _peers("Where DNS queries (53) may go; empty = any address."),
                "kubernetesApiPeers": _peers("Where the head may reach the Kubernetes API while Ray's autoscaler runs; "
                                             "empty = any address on kubernetesApiPorts."),
                "kubernetesApiPorts": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "description": "Ports of the Kubernetes API.",
                },
                "egressPeers": _peers("Other destinations every Ray pod may reach, on every port (model hub, Redis); empty = none."),
                "extraEgress": _k8s("Further NetworkPolicyEgressRule objects.", "array"),
            },
            "NetworkPolicies of the Ray pods (ingress and egress).",
        ),
    }


def build_schema() -> Schema:
    """The whole values.schema.json document."""
    properties = chart_properties()
    properties["kvtide"] = kvtide_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": f"GENERATED by `{REGENERATE_HINT}` from config/ and helm/generate_schema.py; do not edit.",
        "title": "kvtide Helm chart values",
        "type": "object",
        "additionalProperties": False,
        "required": ["image", "kvtide", "workerGroups"],
        "properties": dict(sorted(properties.items())),
    }


def render(schema: Schema) -> str:
    return json.dumps(schema, indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed schema is stale")
    args = parser.parse_args(argv)
    text = render(build_schema())
    if args.check:
        if not SCHEMA_PATH.is_file() or SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_PATH} is stale; run `{REGENERATE_HINT}` and commit it", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
