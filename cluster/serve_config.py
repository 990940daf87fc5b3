"""The Ray Serve config document of a kvtide cluster (what `serve deploy` and KubeRay read).

One application, `kvtide.cluster.app:build_app`, whose `args` are the kvtide config itself: the
app builder parses them back with `parse_config`, so a config file, `kvtide serve`, a
`serve deploy` of this document and the Helm chart's `serveConfigV2` all start the same
cluster. The chart renders the same structure in helm/kvtide/templates/_helpers.tpl
("kvtide.serveConfig"); tests/unit/test_helm_chart.py pins the two together.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from kvtide.config import KvtideConfig, config_to_dict
from kvtide.deployments.internal_auth import SECRET_FILE_ENV

APP_NAME = "kvtide"
APP_IMPORT_PATH = "kvtide.cluster.app:build_app"


def serve_config(config: KvtideConfig) -> dict[str, Any]:
    """The Ray Serve config (ServeDeploySchema) that runs `config` on an existing Ray cluster."""
    return {
        # A proxy on every node, so any pod's Serve port answers (KubeRay health-checks each).
        "proxy_location": "EveryNode",
        # 0.0.0.0, not config.http.host: in a Ray cluster the proxy must accept traffic
        # from other hosts (a Kubernetes Service, a load balancer).
        "http_options": {"host": "0.0.0.0", "port": config.http.port},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": APP_IMPORT_PATH,
                "args": config_to_dict(config),
            }
        ],
    }


def serve_config_yaml(config: KvtideConfig) -> str:
    """`serve_config` as YAML, keys in declaration order, for `serve deploy FILE`.

    Headed by comments naming the process-level settings (`ray_env_exports`): a Serve config
    document cannot carry them, as Ray reads them when each node's processes start.
    """
    env = "\n".join(f"#   {line}" for line in ray_env_exports(config).splitlines())
    header = ("# Ray Serve config of a kvtide cluster: `serve deploy` this file.\n"
              "# Start every Ray node (head and workers) with this environment first: Ray reads it when the\n"
              "# node's processes start (HAProxy ingress, retries, niceness). The Helm chart sets the same on\n"
              "# every pod; `kvtide serve-config --env` prints it as shell exports for `ray start`.\n"
              f"{env}\n")
    return header + yaml.safe_dump(serve_config(config), sort_keys=False, default_flow_style=False)


def ray_env_exports(config: KvtideConfig) -> str:
    """`export NAME=value` lines of the config's process-level Ray settings (`ray_process_env`); in direct mode also
    kvtide's HAProxy command (the one installed beside this Python) and the cluster secret's file, which the
    shell must name already (the same secret on every node; evaluating the lines fails, saying so, without it)."""
    lines = [f"export {name}={shlex.quote(value)}\n" for name, value in config.ray_process_env().items()]
    if config.http.mode == "direct":
        shim = Path(sys.executable).with_name("kvtide-haproxy")
        lines += [f"export RAY_SERVE_HAPROXY_BINARY_PATH={shlex.quote(str(shim))}\n",
                  f'export {SECRET_FILE_ENV}="${{{SECRET_FILE_ENV}:?set it to a file holding the cluster secret, '
                  'the same on every node: openssl rand -hex 32 > FILE}"\n']
    return "".join(lines)
