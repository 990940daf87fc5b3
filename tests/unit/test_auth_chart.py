"""The chart puts API keys from a Secret into the env var the frontend reads, on every Ray pod; old value names still apply."""

from __future__ import annotations

import pytest
from test_helm_chart import rayservice  # tests/unit is on sys.path (rootdir-relative test modules)

from kvtide.config import parse_config


def _containers(values: dict) -> list[dict]:
    cluster = rayservice(values)["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    return [c for pod in pods for c in pod["template"]["spec"]["containers"]]


def test_existing_secret_becomes_the_api_keys_env_on_head_and_workers():
    """apiKeys.existingSecret maps to env KVTIDE_API_KEYS (secretKeyRef) in every Ray container."""
    for container in _containers({"apiKeys": {"existingSecret": "kvtide-keys"}}):
        env = {e["name"]: e for e in container["env"]}
        assert env["KVTIDE_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "kvtide-keys", "key": "api-keys"}


def test_env_name_follows_the_kvtide_auth_setting():
    """A renamed kvtide.frontend.auth.api_keys_env renames the env var the chart sets."""
    values = {"apiKeys": {"existingSecret": "s", "secretKey": "k"},
              "kvtide": {"frontend": {"auth": {"api_keys_env": "MY_KEYS"}}}}
    for container in _containers(values):
        names = {e["name"] for e in container["env"]}
        assert "MY_KEYS" in names and "KVTIDE_API_KEYS" not in names


def test_no_secret_no_env_and_keys_never_in_the_serve_config():
    """Without a Secret no key env is set; the serveConfigV2 args hold only where keys come from."""
    values = {"apiKeys": {"existingSecret": ""}}
    for container in _containers(values):
        assert "KVTIDE_API_KEYS" not in {e["name"] for e in container["env"]}
    obj = rayservice({"apiKeys": {"existingSecret": "kvtide-keys"}})
    assert "kvtide-keys" not in obj["spec"]["serveConfigV2"]


def test_secret_without_env_name_fails_naming_the_fix():
    """A Secret with api_keys_env null cannot reach the ingress: rendering fails and says so."""
    with pytest.raises(Exception, match="api_keys_env"):
        rayservice({"apiKeys": {"existingSecret": "s"}, "kvtide": {"frontend": {"auth": {"api_keys_env": None}}}})


def test_chart_default_auth_matches_the_config_default():
    """The chart's documented default env name is the config model's default."""
    assert parse_config({}).frontend.auth.api_keys_env == "KVTIDE_API_KEYS"


def test_old_ingress_values_still_configure_the_frontend():
    """Chart values written as kvtide.ingress (the old name) reach the app as frontend and set HAProxy's retries."""
    from test_helm_chart import rendered_serve_config

    values = {"kvtide": {"ingress": {"max_messages": 5, "admission": {"max_retries": 0}}}}
    (app,) = rendered_serve_config(values)["applications"]
    assert "ingress" not in app["args"]
    config = parse_config(app["args"])
    assert config.frontend.max_messages == 5 and config.frontend.admission.max_retries == 0
    for container in _containers(values):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RAY_SERVE_HAPROXY_RETRIES"] == "3"
