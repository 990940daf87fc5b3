"""The Helm chart renders valid objects for real schemas, and rejects bad values by name.

Rendering uses Helm 4's own engine (helm-python-sdk, no helm binary), so values.schema.json,
`fail` calls and template functions behave exactly as at `helm install`. Every rendered
object is validated: core kinds against Kubernetes' OpenAPI schemas (kubernetes-validate,
shipped offline), RayService / PodMonitor / PrometheusRule against the CRDs of KubeRay
v1.7.0 and prometheus-operator v0.93.0 vendored in tests/unit/crds, serveConfigV2 against
Ray Serve's own ServeDeploySchema and kvtide's config model.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvtide.config import KvtideConfig, parse_config
from kvtide.cluster.serve_config import serve_config

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "kvtide"
# Vendored so a plain clone validates offline; provenance and versions in crds/README.md.
CRD_DIR = Path(__file__).resolve().parent / "crds"
KUBE_VERSION = "1.30.0"  # oldest Kubernetes the chart is validated against (Chart.yaml: >=1.27)
RELEASE, NAMESPACE = "demo", "llm"
FULLNAME = "demo-kvtide"
GIB = 1 << 30

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the RayService CRD is 1 MB

# (group/version, kind) -> CRD file in CRD_DIR
_CRD_FILES = {
    ("ray.io/v1", "RayService"): "ray.io_rayservices.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
}

# The chart refuses to render without API keys (kvtide.frontend.auth.require_keys defaults to
# true), so every values override here names the key Secret, or turns keys off explicitly.
API_KEYS_SECRET = "kvtide-api-keys"
KEYS: dict[str, Any] = {"apiKeys": {"existingSecret": API_KEYS_SECRET}}
NO_KEYS: dict[str, Any] = {"kvtide": {"frontend": {"auth": {"require_keys": False}}}}

# Values matrix: each case is a values override as a user would write it in -f my-values.yaml.
CASES: dict[str, dict[str, Any]] = {
    "defaults": {**KEYS},
    "keys_off_explicitly": {**NO_KEYS},
    "tp2_on_2gpu_nodes": {
        **KEYS,
        "kvtide": {"engine": {"tensor_parallel_size": 2}},
        "workerGroups": [{"name": "a100x2", "gpusPerPod": 2, "acceleratorType": "NVIDIA-A100-SXM4-80GB"}],
    },
    "tp4_several_replicas": {
        **KEYS,
        "kvtide": {
            "model": "meta-llama/Llama-3.1-70B-Instruct",
            "served_model_name": "llama-70b",
            "engine": {"tensor_parallel_size": 4, "max_model_len": 16384, "gpu_memory_utilization": 0.92},
            "replicas": {"min_replicas": 2, "max_replicas": 6},
        },
        "workerGroups": [
            {"name": "h200x8", "gpusPerPod": 8, "acceleratorType": "NVIDIA-H200"},
            {"name": "h100x4", "gpusPerPod": 4, "acceleratorType": "NVIDIA-H100-80GB-HBM3"},
        ],
        "modelCache": {"type": "pvc", "pvc": {"claimName": "models"}},
        "hfToken": {"secretName": "hf-token"},
    },
    "fixed_replicas": {
        **KEYS,
        "kvtide": {"replicas": {"num_replicas": 3, "min_replicas": None, "max_replicas": None}},
        "modelCache": {"type": "hostPath"},
    },
    "monitoring_off": {
        **KEYS,
        "monitoring": {"podMonitor": {"enabled": False}, "prometheusRule": {"enabled": False}, "dashboards": {"enabled": False}},
        "podDisruptionBudget": {"enabled": False},
    },
    "ingress_on": {
        **KEYS,
        "ingress": {"enabled": True, "className": "nginx", "tls": [{"hosts": ["kvtide.example.com"], "secretName": "tls"}]},
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "inference-gateway", "namespace": "gateway"}]},
        "networkPolicy": {
            "servePeers": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}],
            "metricsPeers": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prometheus"}}}],
            "dashboardPeers": [{"podSelector": {"matchLabels": {"app": "ray-dashboard-proxy"}}}],
            "egressPeers": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}],
            "extraEgress": [{"ports": [{"port": 443, "protocol": "TCP"}]}],
        },
        "service": {"type": "LoadBalancer"},
    },
    "high_availability": {
        **KEYS,
        "gcsFaultTolerance": {
            "enabled": True,
            "redisAddress": "redis-ha.redis.svc.cluster.local:6379",
            "redisPassword": {"secretName": "redis-auth", "secretKey": "redis-password"},
            "externalStorageNamespace": "kvtide-llm",
        },
        "kvtide": {"replicas": {"min_replicas": 2, "max_replicas": 4}},
        # The head reaches Redis: egress is closed by default.
        "networkPolicy": {"egressPeers": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "redis"}}}]},
        "podDisruptionBudget": {"maxUnavailable": 2, "unhealthyPodEvictionPolicy": "IfHealthyBudget", "head": {"enabled": True}},
    },
    "head_only_proxy": {
        **KEYS,
        "proxyLocation": "HeadOnly",
        "head": {"runsReplicas": True},
        "kvtide": {"http": {"mode": "ingress"}},
    },
    "cpu_kv_tier": {
        **KEYS,
        "kvtide": {"engine": {"kv_offload": {"size_gib": 48.5}}},
        "workerGroups": [
            {"name": "h200x8", "gpusPerPod": 8, "resources": {"requests": {"cpu": "64", "memory": "512Gi"},
                                                              "limits": {"cpu": "64", "memory": "512Gi"}}},
            {"name": "h100x1", "gpusPerPod": 1},
        ],
    },
}


# --- rendering -------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART_DIR)


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the chart renders for `values`, as a `helm install` would send it."""
    manifests = _chart().render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.load_all(text, Loader=_YAML_LOADER) if doc)
    return objects


def notes(values: dict[str, Any]) -> str:
    manifests = _chart().render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def rayservice(values: dict[str, Any]) -> dict[str, Any]:
    (obj,) = by_kind(render(values), "RayService")
    return obj


def rendered_serve_config(values: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice(values)["spec"]["serveConfigV2"])


# --- schemas ---------------------------------------------------------------------------


def _close_objects(schema: Any) -> Any:
    """Forbid fields the CRD does not declare, as `kubectl apply --validate=strict` does.

    Left open, a misplaced field would pass here and be pruned silently by the API
    server; closing every declared object turns that into a test failure.
    """
    if isinstance(schema, list):
        return [_close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _close_objects(value) for key, value in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=None)
def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """A validator for the `v1` openAPIV3Schema of the CRD behind (apiVersion, kind)."""
    path = CRD_DIR / _CRD_FILES[(api_version, kind)]
    crd = yaml.load(path.read_text(), Loader=_YAML_LOADER)
    version = api_version.split("/")[1]
    (spec,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _close_objects(spec["schema"]["openAPIV3Schema"])
    # metadata is validated by the API server itself, not the CRD schema.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def validate_object(obj: dict[str, Any]) -> None:
    """Raise if `obj` is not valid for its kind's real schema."""
    key = (obj["apiVersion"], obj["kind"])
    if key in _CRD_FILES:
        errors = sorted(crd_validator(*key).iter_errors(obj), key=lambda e: list(e.path))
        assert not errors, f"{obj['kind']} {obj['metadata']['name']}: " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5]
        )
        return
    if obj["apiVersion"].startswith("gateway.networking.k8s.io/"):
        # No Gateway API CRD is vendored in tests/unit/crds; check_httproute pins its shape.
        check_httproute(obj)
        return
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def check_httproute(route: dict[str, Any]) -> None:
    """The HTTPRoute fields the Gateway API requires, and that it targets our Service."""
    spec = route["spec"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert spec["parentRefs"] and all("name" in ref for ref in spec["parentRefs"])
    (rule,) = spec["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [{"name": FULLNAME, "port": 8000}]


# --- tests: every case renders valid objects ---------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_object_is_valid_for_its_real_schema(case: str) -> None:
    """Each values case renders objects that Kubernetes and the KubeRay/Prometheus CRDs accept."""
    objects = render(CASES[case])
    assert by_kind(objects, "RayService") and by_kind(objects, "Service")
    for obj in objects:
        validate_object(obj)
        assert len(obj["metadata"]["name"]) <= 63


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_is_clean(case: str) -> None:
    """`helm lint --strict` (schema included) reports nothing above info for each values case."""
    report = helm.lint(CHART_DIR, copy.deepcopy(CASES[case]), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


def test_crd_validation_catches_a_misplaced_field() -> None:
    """The CRD check is not vacuous: a field KubeRay does not know fails instead of being pruned."""
    obj = rayservice(KEYS)
    obj["spec"]["rayClusterConfig"]["headGroupSpec"]["gpus"] = 1
    with pytest.raises(AssertionError, match="headGroupSpec"):
        validate_object(obj)


# --- tests: the RayService ---------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_serve_config_args_are_the_kvtide_values(case: str) -> None:
    """serveConfigV2's args are the merged `kvtide` values, plus only where the mounted API key file is."""
    values = _chart().merge_values(copy.deepcopy(CASES[case]))
    merged = values["kvtide"]
    if values["apiKeys"]["existingSecret"]:
        # The one thing the chart adds: keys come from the Secret it mounts, and from no env var.
        auth = merged.setdefault("frontend", {}).setdefault("auth", {})
        auth.update(api_keys_file=f"/etc/kvtide/api-keys/{values['apiKeys']['secretKey']}", api_keys_env=None)
    (app,) = rendered_serve_config(CASES[case])["applications"]
    assert app["args"] == merged  # otherwise verbatim: the chart drops and renames nothing
    assert parse_config(app["args"]) == parse_config(merged)


def test_serve_config_args_carry_the_given_values() -> None:
    """Values a user sets (model, TP, bounds, memory share) arrive in the engine config."""
    (app,) = rendered_serve_config(CASES["tp4_several_replicas"])["applications"]
    config = parse_config(app["args"])
    assert config.model == "meta-llama/Llama-3.1-70B-Instruct"
    assert config.model_name == "llama-70b"
    assert config.engine.tensor_parallel_size == 4
    assert config.engine.max_model_len == 16384
    assert config.engine.gpu_memory_utilization == pytest.approx(0.92)
    assert (config.replicas.min_replicas, config.replicas.max_replicas) == (2, 6)
    assert config.resources.device == "gpu" and config.http.host == "0.0.0.0"


def _drop_nulls(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _drop_nulls(value) for key, value in node.items() if value is not None}
    if isinstance(node, list):
        return [_drop_nulls(item) for item in node]
    return node


@pytest.mark.parametrize("case", CASES)
def test_chart_serve_config_equals_kvtide_serve_config(case: str) -> None:
    """The chart's serveConfigV2 is `kvtide serve-config`'s document, up to the nulls Helm drops and proxyLocation."""
    rendered = rendered_serve_config(CASES[case])
    config = parse_config(rendered["applications"][0]["args"])
    expected = _drop_nulls(serve_config(config))
    # Nulls the chart writes itself (auth.api_keys_env with a key Secret) count as dropped too.
    rendered = _drop_nulls(rendered)
    # The one chart value that is not kvtide config; its default is serve-config's EveryNode.
    expected["proxy_location"] = CASES[case].get("proxyLocation", expected["proxy_location"])
    assert rendered == expected


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's own pydantic-v1-style fields
def test_serve_config_is_a_valid_ray_serve_deploy_config() -> None:
    """Ray Serve 2.60's own ServeDeploySchema accepts the rendered serveConfigV2."""
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(rendered_serve_config(KEYS))
    (app,) = schema.applications
    assert (app.import_path, app.route_prefix) == ("kvtide.cluster.app:build_app", "/")
    assert schema.http_options.port == 8000 and schema.proxy_location.value == "EveryNode"
    head_only = ServeDeploySchema.model_validate(rendered_serve_config(CASES["head_only_proxy"]))
    assert head_only.proxy_location.value == "HeadOnly"


def _worker_groups(values: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    """(name, GPUs per pod, min pods, max pods) of each worker group."""
    groups = rayservice(values)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    out = []
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert int(container["resources"]["requests"]["nvidia.com/gpu"]) == gpus
        assert group["rayStartParams"]["num-gpus"] == str(gpus)
        out.append((group["groupName"], gpus, group["minReplicas"], group["maxReplicas"]))
    return out


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        # TP 1, 1 GPU per pod: pods = engine replicas.
        ("defaults", [("gpu", 1, 1, 4)]),
        # TP 2 on 2-GPU pods: one engine per pod.
        ("tp2_on_2gpu_nodes", [("a100x2", 2, 1, 4)]),
        # TP 4 on 8-GPU pods holds 2 engines: ceil(2/2)=1 .. ceil(6/2)=3; the fallback
        # 4-GPU group starts at 0 and can host all 6 engines alone.
        ("tp4_several_replicas", [("h200x8", 8, 1, 3), ("h100x4", 4, 0, 6)]),
        # Fixed 3 engines: exactly 3 pods.
        ("fixed_replicas", [("gpu", 1, 3, 3)]),
    ],
)
def test_worker_pods_follow_replica_bounds_and_tensor_parallelism(case: str, expected: list) -> None:
    """Worker pod bounds are kvtide replica bounds x TP / gpusPerPod, rounded up."""
    assert _worker_groups(CASES[case]) == expected


def test_gpu_share_packs_several_engines_per_worker_pod() -> None:
    """gpus_per_worker 0.5 on 2-GPU pods: 4 engines per pod, so 1..8 engines need 1..2 pods."""
    values = {**KEYS, "kvtide": {"resources": {"gpus_per_worker": 0.5}, "engine": {"kv_cache_memory_bytes": 1 << 33},
                         "replicas": {"min_replicas": 1, "max_replicas": 8}},
              "workerGroups": [{"name": "gpu", "gpusPerPod": 2}]}
    assert _worker_groups(values) == [("gpu", 2, 1, 2)]


def test_worker_groups_without_resources_get_the_worker_defaults() -> None:
    """A user-written worker group (which Helm does not merge with the default list) still gets CPU/memory."""
    groups = rayservice(CASES["tp4_several_replicas"])["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": str(_worker_gpus(group))}


def _worker_memory(values: dict[str, Any]) -> dict[str, tuple[Any, Any, Any]]:
    """{group: (memory request, memory limit, /dev/shm size limit)} of each worker group's pods."""
    out = {}
    for group in rayservice(values)["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        (shm,) = [v["emptyDir"]["sizeLimit"] for v in spec["volumes"] if v["name"] == "dshm"]
        resources = container["resources"]
        out[group["groupName"]] = (resources["requests"].get("memory"), resources["limits"].get("memory"), shm)
    return out


def test_worker_memory_and_shm_grow_by_the_cpu_kv_tier_of_every_engine_in_the_pod() -> None:
    """A worker pod's memory request, limit and /dev/shm grow by engines per pod x size_gib; the head's do not."""
    memory = _worker_memory(CASES["cpu_kv_tier"])
    # 8 engines x 48.5 GiB = 388 GiB on 512Gi and on /dev/shm's 16Gi; one engine x 48.5 GiB on the defaults' 64Gi.
    assert memory == {"h200x8": ("900Gi", "900Gi", "404Gi"), "h100x1": ("115200Mi", "115200Mi", "66048Mi")}
    head = rayservice(CASES["cpu_kv_tier"])["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert head["containers"][0]["resources"] == rayservice(KEYS)["spec"]["rayClusterConfig"]["headGroupSpec"][
        "template"]["spec"]["containers"][0]["resources"]
    assert [v["emptyDir"]["sizeLimit"] for v in head["volumes"] if v["name"] == "dshm"] == ["16Gi"]


def test_worker_memory_is_as_configured_without_a_cpu_kv_tier() -> None:
    """Without size_gib (default, or kv_offload without one) worker memory and /dev/shm are the values verbatim."""
    off = {**CASES["cpu_kv_tier"], "kvtide": {"engine": {"kv_offload": {"backend": "native", "load_gib_per_s": 40}}}}
    assert _worker_memory(off) == {"h200x8": ("512Gi", "512Gi", "16Gi"), "h100x1": ("64Gi", "64Gi", "16Gi")}
    assert _worker_memory(KEYS) == {"gpu": ("64Gi", "64Gi", "16Gi")}


def test_the_cpu_kv_tier_adds_to_memory_written_in_any_unit_and_is_the_request_when_none_is_given() -> None:
    """Memory in bytes or decimal units grows by the tiers; with no memory given the request is the tiers' alone."""
    values = {**KEYS, "kvtide": {"engine": {"kv_offload": {"size_gib": 2}}}, "workerGroups": [
        {"name": "bytes", "gpusPerPod": 2,
         "resources": {"requests": {"memory": 68719476736}, "limits": {"memory": "100G"}}},
        {"name": "request-only", "resources": {"requests": {"cpu": "8", "memory": "32Gi"}}},
        {"name": "none", "resources": {"requests": {"cpu": "8"}}}]}
    assert _worker_memory(values) == {
        "bytes": ("68Gi", str(100 * 10**9 + 4 * GIB), "20Gi"),
        "request-only": ("34Gi", None, "18Gi"),
        "none": ("2Gi", None, "18Gi"),
    }
    for obj in render(values):
        validate_object(obj)


def _worker_gpus(group: dict[str, Any]) -> int:
    return int(group["rayStartParams"]["num-gpus"])


def test_gpus_per_pod_defaults_to_tensor_parallel_size() -> None:
    """Without gpusPerPod, a worker pod gets exactly one engine's GPUs (TP)."""
    assert _worker_groups({**KEYS, "kvtide": {"engine": {"tensor_parallel_size": 4}}}) == [("gpu", 4, 1, 4)]


def test_explicit_worker_bounds_override_the_derived_ones() -> None:
    """A worker group's minReplicas/maxReplicas, when given, win over the derivation."""
    values = {**KEYS, "workerGroups": [{"name": "gpu", "minReplicas": 0, "maxReplicas": 10}]}
    assert _worker_groups(values) == [("gpu", 1, 0, 10)]


def test_autoscaling_follows_the_replicas_mode() -> None:
    """Ray's in-tree autoscaler is on for min/max replicas and off for a fixed count."""
    auto = rayservice(KEYS)["spec"]["rayClusterConfig"]
    fixed = rayservice(CASES["fixed_replicas"])["spec"]["rayClusterConfig"]
    assert auto["enableInTreeAutoscaling"] is True and auto["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    assert fixed["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in fixed
    assert fixed["workerGroupSpecs"][0]["replicas"] == 3


def test_head_has_no_gpus_and_exports_metrics() -> None:
    """The head runs Serve control plane only: num-gpus 0, num-cpus 0, dashboard on 0.0.0.0, metrics on 8080."""
    cluster = rayservice(KEYS)["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"] == {"num-gpus": "0", "num-cpus": "0", "dashboard-host": "0.0.0.0", "metrics-export-port": "8080"}
    (container,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["serve"] == 8000 and ports["metrics"] == 8080


def test_head_runs_replicas_only_when_asked() -> None:
    """head.runsReplicas drops num-cpus 0 (Ray counts the head's CPUs, or the user's num-cpus); never GPUs."""
    params = rayservice({**KEYS, "head": {"runsReplicas": True}})["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert "num-cpus" not in params and params["num-gpus"] == "0"
    mine = {**KEYS, "head": {"runsReplicas": True, "rayStartParams": {"num-cpus": "2", "num-gpus": "1"}}}
    params = rayservice(mine)["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert (params["num-cpus"], params["num-gpus"]) == ("2", "0")
    # Off (the default), the chart's num-cpus 0 wins over the user's.
    off = {**KEYS, "head": {"rayStartParams": {"num-cpus": "4"}}}
    assert rayservice(off)["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_ports_follow_the_kvtide_http_and_metrics_ports() -> None:
    """Moving kvtide.http.port/metrics.port moves Serve's port, the container ports and the Ray flags together."""
    values = {**KEYS, "kvtide": {"http": {"port": 9000}, "metrics": {"port": 9090}}}
    objects = render(values)
    for obj in objects:
        validate_object(obj)
    (service,) = by_kind(objects, "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    assert yaml.safe_load(service["spec"]["serveConfigV2"])["http_options"]["port"] == 9000
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert (ports["serve"], ports["metrics"]) == (9000, 9090)
    (worker,) = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in worker["ports"]} == {"serve": 9000, "metrics": 9090}
    assert cluster["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == "9090"
    assert cluster["workerGroupSpecs"][0]["rayStartParams"]["metrics-export-port"] == "9090"


def test_worker_pods_get_gpu_scheduling_shm_cache_and_token() -> None:
    """GPU pods tolerate the GPU taint, select the accelerator, and mount /dev/shm and the model cache."""
    spec = rayservice(CASES["tp4_several_replicas"])["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "models"}
    (container,) = spec["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HOME"]["value"] == "/models"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert {"name": "model-cache", "mountPath": "/models"} in container["volumeMounts"]


def test_compile_caches_live_on_the_model_cache_volume_unless_turned_off() -> None:
    """vLLM's torch.compile cache and Triton's kernels go under modelCache.mountPath, so a new replica loads them."""
    def env_of(values: dict) -> dict:
        spec = rayservice(values)["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
        return {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}

    env = env_of(CASES["tp4_several_replicas"])
    assert (env["VLLM_CACHE_ROOT"], env["TRITON_CACHE_DIR"]) == ("/models/.vllm-cache", "/models/.triton-cache")
    off = env_of({**CASES["tp4_several_replicas"], "modelCache": {**CASES["tp4_several_replicas"].get("modelCache", {}),
                                                                    "compileCaches": False}})
    assert "VLLM_CACHE_ROOT" not in off and "TRITON_CACHE_DIR" not in off


def test_upgrade_strategy_is_configurable() -> None:
    """spec.upgradeStrategy.type defaults to NewCluster and takes the value given."""
    assert rayservice(KEYS)["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    assert rayservice({**KEYS, "upgradeStrategy": {"type": "None"}})["spec"]["upgradeStrategy"] == {"type": "None"}


# --- tests: the objects around it --------------------------------------------------------


def _pod_templates(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The head's and each worker group's pod template, by group name ("head" for the head)."""
    cluster = rayservice(values)["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return templates


def _selects(selector: dict[str, str], template: dict[str, Any], kuberay_labels: dict[str, str]) -> bool:
    """Whether `selector` matches a pod made from `template` once KubeRay has added its labels."""
    labels = {**template["metadata"]["labels"], **kuberay_labels}
    return selector.items() <= labels.items()


def _container_ports(template: dict[str, Any]) -> dict[str, int]:
    (container,) = template["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_service_targets_the_serving_proxies_on_every_node() -> None:
    """By default the OpenAI Service selects every Ray pod of the release with a healthy Serve proxy: head and workers."""
    values = CASES["tp4_several_replicas"]
    (svc,) = by_kind(render(values), "Service")
    selector = svc["spec"]["selector"]
    assert selector == {"app.kubernetes.io/name": "kvtide", "app.kubernetes.io/instance": RELEASE, "ray.io/serve": "true"}
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "serve", "protocol": "TCP"}]
    templates = _pod_templates(values)
    assert set(templates) == {"head", "h200x8", "h100x4"}
    for name, template in templates.items():
        # KubeRay labels RayService pods ray.io/serve: true on workers (their readiness probe checks the
        # proxy), and on the head while its proxy passes KubeRay's health check.
        assert _selects(selector, template, {"ray.io/serve": "true"}), name
        assert not _selects(selector, template, {"ray.io/serve": "false"}), name
        assert _container_ports(template)["serve"] == 8000, name  # targetPort "serve" resolves on every pod
    assert rendered_serve_config(values)["proxy_location"] == "EveryNode"


def test_head_only_proxy_location_targets_the_head_alone() -> None:
    """proxyLocation HeadOnly runs Serve's one proxy on the head and the Service selects the head pod only."""
    values = CASES["head_only_proxy"]
    assert rendered_serve_config(values)["proxy_location"] == "HeadOnly"
    (svc,) = by_kind(render(values), "Service")
    selector = svc["spec"]["selector"]
    assert selector == {
        "app.kubernetes.io/name": "kvtide",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "ray-head",
        "ray.io/serve": "true",
    }
    templates = _pod_templates(values)
    assert _selects(selector, templates["head"], {"ray.io/serve": "true"})
    assert not _selects(selector, templates["gpu"], {"ray.io/serve": "true"})


def test_gcs_fault_tolerance_is_rendered_only_when_enabled() -> None:
    """gcsFaultToleranceOptions appear only with gcsFaultTolerance.enabled, with Redis address and password Secret."""
    assert "gcsFaultToleranceOptions" not in rayservice(KEYS)["spec"]["rayClusterConfig"]
    off = {**KEYS, "gcsFaultTolerance": {"enabled": False, "redisAddress": "redis:6379"}}
    assert "gcsFaultToleranceOptions" not in rayservice(off)["spec"]["rayClusterConfig"]
    cluster = rayservice(CASES["high_availability"])["spec"]["rayClusterConfig"]
    assert cluster["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis-ha.redis.svc.cluster.local:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "redis-password"}}},
        "externalStorageNamespace": "kvtide-llm",
    }
    # No password Secret and no namespace: KubeRay's defaults (no password, the RayCluster's UID).
    bare = {**KEYS, "gcsFaultTolerance": {"enabled": True, "redisAddress": "redis:6379"}}
    assert rayservice(bare)["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"] == {"redisAddress": "redis:6379"}
    # The head still runs no replica: a head restart leaves the workers' engines serving.
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def _budgets(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each PodDisruptionBudget's spec, by name."""
    return {pdb["metadata"]["name"]: pdb["spec"] for pdb in by_kind(render(values), "PodDisruptionBudget")}


def test_disruption_budgets_keep_proxies_serving() -> None:
    """Workers get a maxUnavailable budget; the head a zero one unless GCS FT makes its restart survivable."""
    release = {"app.kubernetes.io/name": "kvtide", "app.kubernetes.io/instance": RELEASE}
    budgets = _budgets(KEYS)
    assert budgets == {
        f"{FULLNAME}-workers": {
            "maxUnavailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": {**release, "app.kubernetes.io/component": "ray-worker"}},
        },
        f"{FULLNAME}-head": {
            "maxUnavailable": 0,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": {**release, "app.kubernetes.io/component": "ray-head", "ray.io/node-type": "head"}},
        },
    }
    # Each budget covers its pods and no pod is under two budgets (the eviction API refuses those).
    templates = _pod_templates(CASES["tp4_several_replicas"])
    kuberay = {"head": {"ray.io/node-type": "head"}}
    for name, template in templates.items():
        matching = [b for b, spec in budgets.items()
                    if _selects(spec["selector"]["matchLabels"], template, kuberay.get(name, {"ray.io/node-type": "worker"}))]
        assert matching == [f"{FULLNAME}-head" if name == "head" else f"{FULLNAME}-workers"], name

    ha = _budgets(CASES["high_availability"])  # values given; head budget asked for explicitly despite GCS FT
    assert ha[f"{FULLNAME}-workers"]["maxUnavailable"] == 2
    assert {spec["unhealthyPodEvictionPolicy"] for spec in ha.values()} == {"IfHealthyBudget"}
    assert ha[f"{FULLNAME}-head"]["maxUnavailable"] == 0
    # With GCS FT and no explicit choice the head has no budget, and explicit false drops it too.
    ft = {**KEYS, "gcsFaultTolerance": {"enabled": True, "redisAddress": "redis:6379"}}
    assert set(_budgets(ft)) == {f"{FULLNAME}-workers"}
    assert set(_budgets({**KEYS, "podDisruptionBudget": {"head": {"enabled": False}}})) == {f"{FULLNAME}-workers"}
    assert not _budgets(CASES["monitoring_off"])


def test_monitoring_objects_follow_their_switches() -> None:
    """PodMonitor, PrometheusRule and dashboard ConfigMaps exist by default and vanish when off."""
    on, off = render(KEYS), render(CASES["monitoring_off"])
    for kind in ("PodMonitor", "PrometheusRule", "ConfigMap"):
        assert by_kind(on, kind) and not by_kind(off, kind), kind


def test_pod_monitor_scrapes_the_ray_metrics_port_of_all_pods() -> None:
    """The PodMonitor selects head and workers (shared labels) on the named metrics port."""
    (monitor,) = by_kind(render(KEYS), "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kvtide", "app.kubernetes.io/instance": RELEASE}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_alert_rules_select_this_release_and_keep_prometheus_templates() -> None:
    """files/alerts.yaml's KVTIDE_SELECTOR becomes this release's job; {{ $labels }} survives Helm."""
    (rule,) = by_kind(render(KEYS), "PrometheusRule")
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert {"KvtideNoReadyReplicas", "KvtideHighServerErrorRate"} <= alerts.keys()
    job = f'job="{NAMESPACE}/{FULLNAME}"'
    assert f'ray_serve_deployment_replica_healthy{{{job},deployment="Engine"}}' in alerts["KvtideNoReadyReplicas"]["expr"]
    assert f'ray_kvtide_requests_total{{{job},status=~"5.."}}' in alerts["KvtideHighServerErrorRate"]["expr"]
    assert "KVTIDE_SELECTOR" not in json.dumps(rule)
    assert "{{ $labels.model }}" in alerts["KvtideHighServerErrorRate"]["annotations"]["description"]


def test_one_dashboard_configmap_per_json_file() -> None:
    """Each dashboards/*.json becomes a sidecar-labelled ConfigMap holding that file's valid JSON."""
    files = sorted((CHART_DIR / "dashboards").glob("*.json"))
    maps = by_kind(render(KEYS), "ConfigMap")
    assert files and len(maps) == len(files)
    for path, cm in zip(files, sorted(maps, key=lambda m: m["metadata"]["name"])):
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        dashboard = json.loads(cm["data"][path.name])
        assert dashboard == json.loads(path.read_text()) and dashboard["uid"] and dashboard["panels"]


def test_ingress_and_httproute_point_at_the_service() -> None:
    """With ingress and httpRoute on, both route / to the chart's Service."""
    objects = render(CASES["ingress_on"])
    (ingress,) = by_kind(objects, "Ingress")
    (path,) = ingress["spec"]["rules"][0]["http"]["paths"]
    assert path["backend"]["service"] == {"name": FULLNAME, "port": {"name": "http"}}
    (route,) = by_kind(objects, "HTTPRoute")
    check_httproute(route)
    assert not by_kind(render(KEYS), "Ingress") and not by_kind(render(KEYS), "HTTPRoute")


def test_network_policy_opens_only_named_ports_to_outsiders() -> None:
    """Ray pods talk freely; outsiders reach serve, metrics and dashboard ports only from the peers given."""
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(render(CASES["ingress_on"]), "NetworkPolicy")}
    assert set(policies) == {FULLNAME, f"{FULLNAME}-head-apiserver"}
    release = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvtide", "app.kubernetes.io/instance": RELEASE}}}
    operator = _chart().values["networkPolicy"]["kuberayOperatorPeers"]
    rules = policies[FULLNAME]["ingress"]
    assert rules[0] == {"from": [release]}
    values = CASES["ingress_on"]["networkPolicy"]
    assert [([p["port"] for p in rule["ports"]], rule["from"]) for rule in rules[1:]] == [
        ([8000], values["servePeers"] + operator),  # the operator checks the head's proxy
        ([8080], values["metricsPeers"]),
        ([8265], operator + values["dashboardPeers"]),
    ]
    egress = policies[FULLNAME]["egress"]
    assert egress[0] == {"to": [release]}
    assert {"to": values["egressPeers"]} in egress and values["extraEgress"][0] in egress


def test_notes_show_port_forward_and_first_request() -> None:
    """NOTES.txt tells the user how to port-forward and send a chat completion to the served name."""
    text = notes(CASES["tp4_several_replicas"])
    assert f"port-forward svc/{FULLNAME} 8000:8000" in text
    assert "/v1/chat/completions" in text and '"model": "llama-70b"' in text


# --- tests: bad values are rejected, naming the field --------------------------------------


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        ({"kvtide": {"routing": {"policy": "magic"}}}, helm.HelmValuesError, r"/kvtide/routing/policy.*pow2"),
        ({"kvtide": {"modle": "x"}}, helm.HelmValuesError, r"'/kvtide'.*additional properties 'modle'"),
        ({"kvtide": {"engine": {"tensor_parallel_size": 2.5}}}, helm.HelmValuesError, r"/kvtide/engine/tensor_parallel_size"),
        ({"workerGroup": []}, helm.HelmValuesError, r"additional properties 'workerGroup'"),
        (
            {"kvtide": {"replicas": {"min_replicas": 5, "max_replicas": 2}}},
            helm.HelmRenderError,
            r"kvtide\.replicas\.min_replicas=5 is above kvtide\.replicas\.max_replicas=2",
        ),
        (
            {"kvtide": {"engine": {"tensor_parallel_size": 2}}, "workerGroups": [{"name": "gpu", "gpusPerPod": 3}]},
            helm.HelmRenderError,
            r"workerGroups\[0\]\.gpusPerPod=3 is not a multiple of kvtide\.engine\.tensor_parallel_size=2",
        ),
        (
            {"kvtide": {"replicas": {"num_replicas": 2}}},
            helm.HelmRenderError,
            r"kvtide\.replicas: num_replicas=2 .*min_replicas: null",
        ),
        ({"kvtide": {"resources": {"device": "cpu"}}}, helm.HelmRenderError, r"kvtide\.resources\.device=cpu"),
        ({"modelCache": {"type": "pvc"}}, helm.HelmRenderError, r"modelCache\.pvc\.claimName"),
        (
            {"workerGroups": [{"name": "gpu"}, {"name": "gpu"}]},
            helm.HelmRenderError,
            r"workerGroups\[1\]\.name=gpu is used twice",
        ),
        (
            {"gcsFaultTolerance": {"enabled": True}},
            helm.HelmRenderError,
            r"gcsFaultTolerance\.enabled=true needs gcsFaultTolerance\.redisAddress",
        ),
        (
            {"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis:6379"}, "head": {"rayStartParams": {"redis-password": "x"}}},
            helm.HelmRenderError,
            r"head\.rayStartParams\.redis-password is set together with gcsFaultTolerance\.enabled=true",
        ),
        ({"proxyLocation": "Disabled"}, helm.HelmValuesError, r"/proxyLocation.*EveryNode"),
        ({"podDisruptionBudget": {"maxUnavailable": 0}}, helm.HelmValuesError, r"/podDisruptionBudget/maxUnavailable"),
        (
            {"kvtide": {"engine": {"kv_offload": {"size_gib": 0}}}},
            helm.HelmValuesError,
            r"/kvtide/engine/kv_offload/size_gib",
        ),
        (
            {"kvtide": {"engine": {"kv_offload": {"size_gib": 2}}},
             "workerGroups": [{"name": "gpu", "resources": {"requests": {"memory": "lots"}}}]},
            helm.HelmRenderError,
            r"workerGroups\[0\]\.resources\.requests\.memory=lots is not a Kubernetes quantity",
        ),
    ],
    ids=["policy", "unknown_key", "float_tp", "chart_key", "min_gt_max", "gpus_not_tp_multiple", "both_replica_forms", "cpu",
         "pvc_claim", "dup_group", "gcs_ft_no_redis", "gcs_ft_redis_param", "proxy_location", "pdb_zero_workers",
         "kv_offload_zero", "memory_unreadable_with_kv_tier"],
)
def test_bad_values_are_rejected_naming_the_field(values: dict, error: type, message: str) -> None:
    """A bad value fails at template time with the field's path in the message."""
    with pytest.raises(error, match=message):
        render({**KEYS, **values})


def test_chart_defaults_are_a_valid_gpu_config() -> None:
    """values.yaml's kvtide section is a valid GPU KvtideConfig for a real hub model."""
    config = parse_config(_chart().values["kvtide"])
    assert isinstance(config, KvtideConfig)
    assert config.resources.device == "gpu" and config.http.host == "0.0.0.0"
    assert config.model == "meta-llama/Llama-3.1-8B-Instruct" and config.replicas.autoscaling
