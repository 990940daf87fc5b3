"""The chart mounts the API key Secret as a file on every Ray pod and points the frontend at it; old value names still apply."""

from __future__ import annotations

import helm_python as helm
import pytest
from test_helm_chart import KEYS, NO_KEYS, rayservice, rendered_serve_config  # tests/unit is on sys.path

from kvtide.config import parse_config


def _pods(values: dict) -> list[dict]:
    cluster = rayservice(values)["spec"]["rayClusterConfig"]
    return [g["template"]["spec"] for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]]


def _auth(values: dict) -> dict:
    (app,) = rendered_serve_config(values)["applications"]
    return app["args"]["frontend"]["auth"]


def test_existing_secret_is_a_read_only_file_on_head_and_workers():
    """apiKeys.existingSecret becomes a read-only secret volume with only its key, mounted in every Ray container."""
    pods = _pods(KEYS)
    assert len(pods) == 2
    for spec in pods:
        (volume,) = [v for v in spec["volumes"] if v["name"] == "api-keys"]
        assert volume["secret"] == {"secretName": "kvtide-api-keys", "defaultMode": 0o440,
                                    "items": [{"key": "api-keys", "path": "api-keys"}]}
        for container in spec["containers"]:
            assert {"name": "api-keys", "mountPath": "/etc/kvtide/api-keys", "readOnly": True} in container["volumeMounts"]


def test_config_reads_the_mounted_file_and_no_env_var():
    """The rendered config names the mounted file and turns the env source off; no env var carries a key."""
    assert _auth(KEYS) == {"api_keys_env": None, "api_keys_file": "/etc/kvtide/api-keys/api-keys", "require_keys": True,
                           "tenant_cache_isolation": True, "tenant_burst": 20}
    config = parse_config(rendered_serve_config(KEYS)["applications"][0]["args"]).frontend.auth
    assert (config.api_keys_env, config.api_keys_file) == (None, "/etc/kvtide/api-keys/api-keys")
    for spec in _pods(KEYS):
        for container in spec["containers"]:
            names = {e["name"] for e in container["env"]}
            assert "KVTIDE_API_KEYS" not in names
            refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e]
            assert "kvtide-api-keys" not in refs


def test_secret_key_names_the_file():
    """apiKeys.secretKey is both the projected item and the file name the config points at."""
    values = {"apiKeys": {"existingSecret": "team-keys", "secretKey": "keys.txt"}}
    assert _auth(values)["api_keys_file"] == "/etc/kvtide/api-keys/keys.txt"
    for spec in _pods(values):
        (volume,) = [v for v in spec["volumes"] if v["name"] == "api-keys"]
        assert volume["secret"]["secretName"] == "team-keys"
        assert volume["secret"]["items"] == [{"key": "keys.txt", "path": "keys.txt"}]


def test_keys_off_explicitly_mounts_nothing_and_passes_auth_through():
    """require_keys false without a Secret: no key volume, and the auth values reach the app as written."""
    for spec in _pods(NO_KEYS):
        assert "api-keys" not in {v["name"] for v in spec["volumes"]}
    assert _auth(NO_KEYS) == {"api_keys_env": "KVTIDE_API_KEYS", "require_keys": False,
                              "tenant_cache_isolation": True, "tenant_burst": 20}


def test_keys_never_in_the_serve_config():
    """serveConfigV2 names where keys come from, never the Secret."""
    assert "kvtide-api-keys" not in rayservice(KEYS)["spec"]["serveConfigV2"]


def test_a_conflicting_key_file_fails_naming_the_fix():
    """api_keys_file pointing elsewhere while the chart mounts the Secret fails, naming both settings."""
    values = {**KEYS, "kvtide": {"frontend": {"auth": {"api_keys_file": "/keys/other"}}}}
    with pytest.raises(helm.HelmRenderError, match=r"api_keys_file=/keys/other .*apiKeys\.existingSecret"):
        rayservice(values)


def test_chart_env_default_matches_the_config_default():
    """The chart's api_keys_env default is the model's; only require_keys differs (on in the chart)."""
    auth = parse_config({}).frontend.auth
    assert auth.api_keys_env == "KVTIDE_API_KEYS"
    assert auth.require_keys is False
    assert _auth(NO_KEYS)["api_keys_env"] == auth.api_keys_env


def test_old_ingress_values_still_configure_the_frontend():
    """Chart values written as kvtide.ingress (the old name) reach the app as frontend and set HAProxy's retries."""
    values = {**KEYS, "kvtide": {"ingress": {"max_messages": 5, "admission": {"max_retries": 0}}}}
    (app,) = rendered_serve_config(values)["applications"]
    assert "ingress" not in app["args"]
    config = parse_config(app["args"])
    assert config.frontend.max_messages == 5 and config.frontend.admission.max_retries == 0
    assert config.frontend.auth.api_keys_file == "/etc/kvtide/api-keys/api-keys"
    for spec in _pods(values):
        for container in spec["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["RAY_SERVE_HAPROXY_RETRIES"] == "3"
    # The old name can also turn keys off: then no Secret is needed.
    old_off = {"kvtide": {"ingress": {"auth": {"require_keys": False}}}}
    assert parse_config(rendered_serve_config(old_off)["applications"][0]["args"]).frontend.auth.require_keys is False
