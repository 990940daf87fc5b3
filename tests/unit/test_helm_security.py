"""The chart is locked down by its defaults: keys, secrets, Ray token auth, restricted pods, network policy, drains.

Rendering and the CRD/Kubernetes validation come from test_helm_chart. The Pod Security
checker below implements the Kubernetes "restricted" Pod Security Standard (baseline rules
included) on the pods as KubeRay builds them from the RayService: the chart's containers,
plus the autoscaler sidecar KubeRay adds to the head (autoscalerOptions.securityContext) and
the wait-gcs-ready init container it adds to workers (a copy of the Ray container's
securityContext).
"""

from __future__ import annotations

import base64
import copy
import math
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from test_helm_chart import (  # tests/unit is on sys.path (rootdir-relative test modules)
    FULLNAME, KEYS, NO_KEYS, RELEASE, by_kind, render, rayservice, rendered_serve_config, validate_object,
)

from kvtide.config import parse_config
from kvtide.config.model import AdmissionConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
RELEASE_SELECTOR = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvtide",
                                                    "app.kubernetes.io/instance": RELEASE}}}
SERVE_PORT, METRICS_PORT, DASHBOARD_PORT = 8000, 8080, 8265
# Never reachable from outside the release: GCS, Ray client, HAProxy stats and exporter, the
# dashboard agent, and the replicas' direct-ingress HTTP/gRPC port ranges (both ends and middle).
CLOSED_PORTS = (6379, 10001, 8404, 9101, 52365, 30000, 30500, 31000, 40000, 40500, 41000)

# Common ways to run the chart; each must stay inside the restricted profile.
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {**KEYS},
    "keys_off": {**NO_KEYS},
    "autoscaling_wide": {**KEYS, "kvtide": {"replicas": {"min_replicas": 0, "max_replicas": 8}}},
    "fixed_replicas": {**KEYS, "kvtide": {"replicas": {"num_replicas": 2, "min_replicas": None, "max_replicas": None}}},
    "gcs_fault_tolerance": {
        **KEYS,
        "gcsFaultTolerance": {"enabled": True, "redisAddress": "redis:6379",
                              "redisPassword": {"secretName": "redis-auth"}},
        "networkPolicy": {"egressPeers": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "redis"}}}]},
    },
    "pvc_cache_two_groups": {
        **KEYS,
        "modelCache": {"type": "pvc", "pvc": {"claimName": "models"}},
        "kvtide": {"engine": {"tensor_parallel_size": 2}},
        "workerGroups": [{"name": "a", "gpusPerPod": 2}, {"name": "b", "gpusPerPod": 4}],
    },
    "existing_secrets": {
        **KEYS,
        "internalSecret": {"existingSecret": "my-internal"},
        "rayAuth": {"existingSecret": "my-ray-token"},
    },
    "ingress_mode_head_only": {**KEYS, "proxyLocation": "HeadOnly", "kvtide": {"http": {"mode": "ingress"}}},
}


def _autoscaling(values: dict[str, Any]) -> bool:
    return rayservice(values)["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"]


def _pod_specs(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pod specs by group ("head" for the head), as the chart renders them."""
    cluster = rayservice(values)["spec"]["rayClusterConfig"]
    specs = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    specs.update({g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]})
    return specs


def _ray_containers(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for spec in _pod_specs(values).values() for c in spec["containers"]]


# --- API keys ------------------------------------------------------------------------------


def test_default_install_fails_without_a_key_secret_and_names_the_fix():
    """`helm install` with the chart's defaults fails, naming apiKeys.existingSecret, the file format and the opt-out."""
    with pytest.raises(helm.HelmRenderError) as failure:
        render({})
    message = str(failure.value)
    assert "apiKeys.existingSecret" in message and "kubectl create secret generic" in message
    assert "<tenant> <key>" in message and "require_keys=false" in message


def test_chart_defaults_require_keys():
    """values.yaml sets kvtide.frontend.auth.require_keys true (the model's own default stays false)."""
    from test_helm_chart import _chart

    assert _chart().values["kvtide"]["frontend"]["auth"]["require_keys"] is True


def test_explicit_require_keys_false_renders_an_open_api():
    """require_keys false, given explicitly, renders without a Secret and mounts no key file."""
    objects = render(NO_KEYS)
    for obj in objects:
        validate_object(obj)
    (app,) = rendered_serve_config(NO_KEYS)["applications"]
    assert app["args"]["frontend"]["auth"]["require_keys"] is False
    for spec in _pod_specs(NO_KEYS).values():
        assert "api-keys" not in {v["name"] for v in spec["volumes"]}


def test_keys_are_a_file_on_every_pod_and_the_config_points_at_it():
    """Every Ray container mounts the key Secret read-only at /etc/kvtide/api-keys; no env var carries keys."""
    values = {**KEYS, "workerGroups": [{"name": "a"}, {"name": "b"}]}
    specs = _pod_specs(values)
    assert set(specs) == {"head", "a", "b"}
    for name, spec in specs.items():
        (volume,) = [v for v in spec["volumes"] if v["name"] == "api-keys"]
        assert volume["secret"]["secretName"] == "kvtide-api-keys" and volume["secret"]["defaultMode"] <= 0o440, name
        for container in spec["containers"]:
            mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
            assert mount == {"name": "api-keys", "mountPath": "/etc/kvtide/api-keys", "readOnly": True}, name
            assert all("kvtide-api-keys" not in str(e) for e in container["env"]), name
            assert "KVTIDE_API_KEYS" not in {e["name"] for e in container["env"]}, name
    auth = parse_config(rendered_serve_config(values)["applications"][0]["args"]).frontend.auth
    assert auth.api_keys_file == "/etc/kvtide/api-keys/api-keys" and auth.api_keys_env is None and auth.require_keys


# --- the internal secret and Ray's token --------------------------------------------------


def test_internal_secret_is_generated_and_mounted_with_its_env_on_every_pod():
    """<fullname>-internal holds 64 random characters, mounted read-only at /etc/kvtide/internal on every Ray pod with env naming the file."""
    objects = render(KEYS)
    (secret,) = [s for s in by_kind(objects, "Secret") if s["metadata"]["name"] == f"{FULLNAME}-internal"]
    value = base64.b64decode(secret["data"]["secret"])
    assert len(value) == 64 and value.isalnum()
    for name, spec in _pod_specs(KEYS).items():
        (volume,) = [v for v in spec["volumes"] if v["name"] == "internal-secret"]
        assert volume["secret"] == {"secretName": f"{FULLNAME}-internal", "defaultMode": 0o440,
                                    "items": [{"key": "secret", "path": "secret"}]}, name
        for container in spec["containers"]:
            assert {"name": "internal-secret", "mountPath": "/etc/kvtide/internal", "readOnly": True} in container["volumeMounts"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["KVTIDE_INTERNAL_SECRET_FILE"] == "/etc/kvtide/internal/secret", name


def test_existing_internal_secret_replaces_the_generated_one():
    """internalSecret.existingSecret is mounted instead, and the chart renders no Secret of its own."""
    values = VARIANTS["existing_secrets"]
    names = {s["metadata"]["name"] for s in by_kind(render(values), "Secret")}
    assert f"{FULLNAME}-internal" not in names and f"{FULLNAME}-ray-auth" not in names
    for spec in _pod_specs(values).values():
        (volume,) = [v for v in spec["volumes"] if v["name"] == "internal-secret"]
        assert volume["secret"]["secretName"] == "my-internal"


def test_ray_token_authentication_is_on_with_a_chart_secret():
    """authOptions mode token names <fullname>-ray-auth, which holds a random auth_token (KubeRay's key)."""
    objects = render(KEYS)
    (service,) = by_kind(objects, "RayService")
    assert service["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": f"{FULLNAME}-ray-auth"}
    (secret,) = [s for s in by_kind(objects, "Secret") if s["metadata"]["name"] == f"{FULLNAME}-ray-auth"]
    token = base64.b64decode(secret["data"]["auth_token"])
    assert len(token) == 64 and token.isalnum()
    existing = rayservice(VARIANTS["existing_secrets"])["spec"]["rayClusterConfig"]["authOptions"]
    assert existing == {"mode": "token", "secretName": "my-ray-token"}
    off = render({**KEYS, "rayAuth": {"enabled": False}})
    assert by_kind(off, "RayService")[0]["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "disabled"}
    assert f"{FULLNAME}-ray-auth" not in {s["metadata"]["name"] for s in by_kind(off, "Secret")}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_manifest_is_valid(variant: str):
    """Each variant's objects validate against Kubernetes' schemas and the KubeRay/Prometheus CRDs (unknown fields rejected)."""
    objects = render(VARIANTS[variant])
    kinds = {obj["kind"] for obj in objects}
    assert {"RayService", "PodMonitor", "PrometheusRule", "NetworkPolicy", "ServiceAccount", "Service"} <= kinds
    for obj in objects:
        validate_object(obj)


# --- Pod Security Standard "restricted" ---------------------------------------------------

# https://kubernetes.io/docs/concepts/security/pod-security-standards/
_RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                            "projected", "secret"}
_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                 "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                 "net.ipv4.tcp_keepalive_probes"}
_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Every rule of the restricted Pod Security Standard (baseline included) that `spec` breaks."""
    problems: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    containers = [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            problems.append(f"{field} is set")
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if "hostPath" in kinds:
            problems.append(f"volume {volume['name']}: hostPath")
        if not kinds <= _RESTRICTED_VOLUME_TYPES:
            problems.append(f"volume {volume['name']}: type {sorted(kinds - _RESTRICTED_VOLUME_TYPES)} not allowed")
    for sysctl in pod_sc.get("sysctls", []):
        if sysctl["name"] not in _SAFE_SYSCTLS:
            problems.append(f"unsafe sysctl {sysctl['name']}")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        problems.append("pod windowsOptions.hostProcess")
    if pod_sc.get("runAsUser") == 0:
        problems.append("pod runAsUser 0")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        problems.append(f"pod seccompProfile {pod_seccomp}")
    for where, sc in [("pod", pod_sc)]:
        _selinux_and_apparmor(where, sc, problems)
    for container in containers:
        name = container["name"]
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
        if sc.get("runAsNonRoot") is False or not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")):
            problems.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser") == 0:
            problems.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp not in (None, "RuntimeDefault", "Localhost") or (seccomp is None and pod_seccomp is None):
            problems.append(f"{name}: seccompProfile {seccomp or pod_seccomp} (RuntimeDefault or Localhost required)")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            problems.append(f"{name}: windowsOptions.hostProcess")
        if sc.get("procMount", "Default") != "Default":
            problems.append(f"{name}: procMount {sc['procMount']}")
        for port in container.get("ports", []):
            if port.get("hostPort"):
                problems.append(f"{name}: hostPort {port['hostPort']}")
        _selinux_and_apparmor(name, sc, problems)
    return problems


def _selinux_and_apparmor(where: str, sc: dict[str, Any], problems: list[str]) -> None:
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in _SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        problems.append(f"{where}: seLinuxOptions {selinux}")
    apparmor = (sc.get("appArmorProfile") or {}).get("type")
    if apparmor not in (None, "RuntimeDefault", "Localhost"):
        problems.append(f"{where}: appArmorProfile {apparmor}")


def kuberay_pods(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pod specs as KubeRay creates them: the head with its autoscaler sidecar, workers with wait-gcs-ready."""
    cluster = rayservice(values)["spec"]["rayClusterConfig"]
    specs = _pod_specs(values)
    head = copy.deepcopy(specs["head"])
    if cluster["enableInTreeAutoscaling"]:
        options = cluster.get("autoscalerOptions", {})
        sidecar = {"name": "autoscaler", "securityContext": options.get("securityContext")}
        head["containers"].append(sidecar)
        head["volumes"].append({"name": "ray-logs", "emptyDir": {}})
    pods = {"head": head}
    for name, spec in specs.items():
        if name == "head":
            continue
        worker = copy.deepcopy(spec)
        ray = worker["containers"][0]
        worker["initContainers"] = [{"name": "wait-gcs-ready", "securityContext": copy.deepcopy(ray.get("securityContext"))}]
        pods[name] = worker
    return pods


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_meets_the_restricted_pod_security_standard(variant: str):
    """Head (with KubeRay's autoscaler sidecar) and every worker (with its init container) pass the restricted profile."""
    pods = kuberay_pods(VARIANTS[variant])
    for name, spec in pods.items():
        assert restricted_violations(spec) == [], (variant, name)
    if _autoscaling(VARIANTS[variant]):
        assert [c["name"] for c in pods["head"]["containers"]] == ["ray-head", "autoscaler"]


def test_the_restricted_checker_is_not_vacuous():
    """The checker flags a hostPath cache, a privileged container, a missing drop, root, escalation and host namespaces."""
    spec = kuberay_pods(KEYS)["gpu"]
    assert restricted_violations(kuberay_pods({**KEYS, "modelCache": {"type": "hostPath"}})["gpu"]) == [
        "volume model-cache: hostPath", "volume model-cache: type ['hostPath'] not allowed"]
    broken = copy.deepcopy(spec)
    broken["hostNetwork"] = True
    broken["securityContext"]["runAsUser"] = 0
    broken["securityContext"]["sysctls"] = [{"name": "kernel.msgmax", "value": "1"}]
    ray = broken["containers"][0]
    ray["securityContext"].update(privileged=True, allowPrivilegeEscalation=True, capabilities={"add": ["SYS_ADMIN"]})
    ray["ports"].append({"containerPort": 1, "hostPort": 1})
    found = " | ".join(restricted_violations(broken))
    for expected in ("hostNetwork", "runAsUser 0", "kernel.msgmax", "privileged", "allowPrivilegeEscalation",
                     "do not drop ALL", "SYS_ADMIN", "hostPort"):
        assert expected in found, expected
    no_seccomp = copy.deepcopy(spec)
    del no_seccomp["securityContext"]["seccompProfile"]
    assert any("seccompProfile" in p for p in restricted_violations(no_seccomp))


def test_containers_run_read_only_with_writable_scratch():
    """Every Ray container and the autoscaler run with a read-only root, writing only to emptyDirs for /tmp and home caches."""
    for values in (KEYS, VARIANTS["fixed_replicas"]):
        for name, spec in _pod_specs(values).items():
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}} and volumes["home"] == {"name": "home", "emptyDir": {}}
            for container in spec["containers"]:
                assert container["securityContext"]["readOnlyRootFilesystem"] is True
                mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
                assert mounts["/tmp"]["name"] == "tmp", name  # /tmp/ray (Ray's session), /tmp/haproxy-serve
                for sub in ("cache", "config", "triton", "nv"):
                    assert mounts[f"/home/ray/.{sub}"] == {"name": "home", "mountPath": f"/home/ray/.{sub}", "subPath": sub}
                writable = [m for m in container["volumeMounts"] if not m.get("readOnly")]
                assert all(volumes[m["name"]].get("emptyDir") is not None or m["name"] == "model-cache" for m in writable)
    options = rayservice(KEYS)["spec"]["rayClusterConfig"]["autoscalerOptions"]
    assert options["securityContext"]["readOnlyRootFilesystem"] is True
    assert options["volumeMounts"][0] == {"name": "autoscaler-tmp", "mountPath": "/tmp"}
    assert all(m.get("readOnly") for m in options["volumeMounts"][1:])  # the API token
    head_volumes = {v["name"] for v in _pod_specs(KEYS)["head"]["volumes"]}
    assert "autoscaler-tmp" in head_volumes


def test_dockerfile_user_matches_the_pod_security_context():
    """The image's USER is the numeric non-root uid:gid the chart's podSecurityContext runs as."""
    from test_helm_chart import _chart

    users = re.findall(r"^USER\s+(\S+)", (REPO_ROOT / "Dockerfile").read_text(), flags=re.M)
    pod = _chart().values["podSecurityContext"]
    assert users and users[-1] == f"{pod['runAsUser']}:{pod['runAsGroup']}" and pod["runAsUser"] != 0


# --- ServiceAccounts ------------------------------------------------------------------------


def test_only_the_autoscaler_sidecar_holds_an_api_token():
    """No pod automounts an API token; with Ray's autoscaler the head's own account's token is projected into the sidecar alone."""
    for values, autoscaling in ((KEYS, True), (VARIANTS["fixed_replicas"], False)):
        objects = render(values)
        accounts = {sa["metadata"]["name"]: sa for sa in by_kind(objects, "ServiceAccount")}
        assert all(sa["automountServiceAccountToken"] is False for sa in accounts.values())
        assert (f"{FULLNAME}-head" in accounts) is autoscaling
        for name, spec in _pod_specs(values).items():
            assert spec["automountServiceAccountToken"] is False, name
            # KubeRay binds its autoscaler Role to the head pod's account: its own, never the workers'.
            expected = f"{FULLNAME}-head" if name == "head" and autoscaling else FULLNAME
            assert spec["serviceAccountName"] == expected and expected in accounts, name
            for container in spec["containers"]:
                assert all("serviceaccount" not in m["mountPath"] for m in container["volumeMounts"]), name
            projected = [v for v in spec["volumes"] if "projected" in v]
            assert (name == "head" and autoscaling) is bool(projected), name
        cluster = rayservice(values)["spec"]["rayClusterConfig"]
        if autoscaling:
            (volume,) = [v for v in cluster["headGroupSpec"]["template"]["spec"]["volumes"] if v["name"] == "kube-api-access"]
            sources = volume["projected"]["sources"]
            assert sources[0] == {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}
            assert sources[1]["configMap"]["name"] == "kube-root-ca.crt"
            assert {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                    "readOnly": True} in cluster["autoscalerOptions"]["volumeMounts"]
        else:
            assert "autoscalerOptions" not in cluster


# --- NetworkPolicy --------------------------------------------------------------------------


def _policies(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p["spec"] for p in by_kind(render(values), "NetworkPolicy")}


def _ports(rule: dict[str, Any]) -> list[tuple[int, int]]:
    """(first, last) port ranges of a rule; a rule without ports covers every port."""
    if "ports" not in rule:
        return [(1, 65535)]
    return [(int(p["port"]), int(p.get("endPort", p["port"]))) for p in rule["ports"]]


def _covers(rule: dict[str, Any], port: int) -> bool:
    return any(first <= port <= last for first, last in _ports(rule))


def _outsiders_allowed(rule: dict[str, Any]) -> bool:
    """Whether a rule admits any pod outside the release (no `from` admits everyone)."""
    return "from" not in rule or any(peer != RELEASE_SELECTOR for peer in rule["from"])


def check_ingress_invariants(spec: dict[str, Any]) -> None:
    """Outsiders get the serve port from anywhere at most; every other port needs a listed peer; the closed ports never."""
    for rule in spec["ingress"]:
        if "from" not in rule:
            assert _ports(rule) == [(SERVE_PORT, SERVE_PORT)], rule
        if _outsiders_allowed(rule):
            assert "ports" in rule and rule.get("from", True), rule  # never every port, never an empty from
            for port in CLOSED_PORTS:
                assert not _covers(rule, port), (port, rule)


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policy_is_on_and_keeps_ports_closed(variant: str):
    """Every variant has the policy (ingress and egress); no rule opens a port other than serve to everyone, nor the closed ports to outsiders."""
    policies = _policies(VARIANTS[variant])
    spec = policies[FULLNAME]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["podSelector"] == {"matchLabels": RELEASE_SELECTOR["podSelector"]["matchLabels"]}
    assert spec["ingress"][0] == {"from": [RELEASE_SELECTOR]}  # the release's pods: every port
    check_ingress_invariants(spec)
    assert (f"{FULLNAME}-head-apiserver" in policies) is _autoscaling(VARIANTS[variant])


def test_dashboard_is_open_only_to_the_operator_and_closed_when_no_peer_is_given():
    """8265 admits the KubeRay operator peers; with those and dashboardPeers empty no rule mentions 8265 at all."""
    from test_helm_chart import _chart

    operator = _chart().values["networkPolicy"]["kuberayOperatorPeers"]
    assert operator and all("namespaceSelector" in p for p in operator)
    (dashboard,) = [r for r in _policies(KEYS)[FULLNAME]["ingress"] if _covers(r, DASHBOARD_PORT) and r.get("ports")]
    assert dashboard == {"ports": [{"port": DASHBOARD_PORT, "protocol": "TCP"}], "from": operator}
    closed = {**KEYS, "networkPolicy": {"kuberayOperatorPeers": [], "dashboardPeers": [], "metricsPeers": []}}
    spec = _policies(closed)[FULLNAME]
    outside = [r for r in spec["ingress"] if _outsiders_allowed(r)]
    assert outside == [{"ports": [{"port": SERVE_PORT, "protocol": "TCP"}]}]  # the serve port alone
    check_ingress_invariants(spec)
    # A moved dashboard port is the one the rule opens.
    moved = _policies({**KEYS, "head": {"rayStartParams": {"dashboard-port": "8266"}}})[FULLNAME]
    assert any(_covers(r, 8266) and _outsiders_allowed(r) for r in moved["ingress"])
    assert not any(_covers(r, DASHBOARD_PORT) and _outsiders_allowed(r) for r in moved["ingress"])


def test_metrics_port_is_open_only_to_the_monitoring_namespace():
    """The metrics port admits only metricsPeers (default: the monitoring namespace)."""
    rules = [r for r in _policies(KEYS)[FULLNAME]["ingress"] if "ports" in r and _covers(r, METRICS_PORT)]
    assert rules == [{"ports": [{"port": METRICS_PORT, "protocol": "TCP"}],
                      "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}]


def test_serve_peers_restrict_the_serve_port_but_keep_the_operator():
    """Given servePeers, the serve port admits them and the KubeRay operator (its head proxy check), nobody else."""
    from test_helm_chart import _chart

    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
    (rule,) = [r for r in _policies({**KEYS, "networkPolicy": {"servePeers": peers}})[FULLNAME]["ingress"]
               if "ports" in r and _covers(r, SERVE_PORT)]
    assert rule["from"] == peers + _chart().values["networkPolicy"]["kuberayOperatorPeers"]


def test_egress_is_limited_to_the_release_dns_the_api_and_given_peers():
    """Egress: the release's pods, DNS (53), the API server from the autoscaling head only, and egressPeers/extraEgress."""
    policies = _policies(KEYS)
    egress = policies[FULLNAME]["egress"]
    assert egress == [
        {"to": [RELEASE_SELECTOR]},
        {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
         "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}]},
    ]
    api = policies[f"{FULLNAME}-head-apiserver"]
    assert api["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "ray-head"
    assert api["policyTypes"] == ["Egress"] and "ingress" not in api
    assert api["egress"] == [{"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]}]
    hub = [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}]
    given = _policies({**KEYS, "networkPolicy": {"egressPeers": hub, "kubernetesApiPeers": [{"ipBlock": {"cidr": "10.0.0.1/32"}}]}})
    assert {"to": hub} in given[FULLNAME]["egress"]
    assert given[f"{FULLNAME}-head-apiserver"]["egress"][0]["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    assert not _policies({**KEYS, "networkPolicy": {"enabled": False}})


# --- drains ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("kvtide", "deadline"), [
    ({}, AdmissionConfig().request_timeout_s),
    ({"frontend": {"admission": {"request_timeout_s": 1200.5}}}, 1200.5),
    ({"ingress": {"admission": {"request_timeout_s": 90}}}, 90),  # the old name of frontend
    # No deadline: the drain is bounded by the model's default deadline.
    ({"frontend": {"admission": {"request_timeout_s": None}}}, AdmissionConfig().request_timeout_s),
])
def test_grace_period_outlasts_the_request_deadline_and_prestop_drains(kvtide: dict, deadline: float):
    """Every Ray pod's grace period is >= request_timeout_s + 30 s; preStop drains for request_timeout_s + 10 s, then stops Ray."""
    values = {**KEYS, "kvtide": kvtide} if kvtide else KEYS
    for name, spec in _pod_specs(values).items():
        assert spec["terminationGracePeriodSeconds"] >= deadline + 30, name
        assert spec["terminationGracePeriodSeconds"] == math.ceil(deadline) + 30, name
        for container in spec["containers"]:
            command = container["lifecycle"]["preStop"]["exec"]["command"]
            assert command == ["/bin/sh", "-c", f"kvtide drain-node --timeout-s {math.ceil(deadline) + 10} ; ray stop"]


def test_api_description_is_off_by_default():
    """The rendered config keeps /docs and /openapi.json off (frontend.openapi_docs false)."""
    (app,) = rendered_serve_config(KEYS)["applications"]
    assert app["args"]["frontend"]["openapi_docs"] is False
    assert parse_config(app["args"]).frontend.openapi_docs is False
