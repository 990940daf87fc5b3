# kvtide serving image: the Ray head, the GPU workers and the Ray autoscaler sidecar of the
# Helm chart (helm/kvtide) all run it.
#
#   docker build -t REGISTRY/kvtide:0.1.0 .
#   docker push REGISTRY/kvtide:0.1.0
#
# Why rayproject/ray and not vllm/vllm-openai as the base:
#  - KubeRay needs the exact Ray of the RayService's rayVersion (2.60.0) on every pod, and
#    expects the Ray image's layout: `ray` on PATH, the `ray` user, and wget/bash that its
#    injected readiness/liveness probes call. The Ray image is built and tested for that.
#  - vLLM installs from PyPI on top (its wheel brings its own torch and CUDA libraries),
#    while the vLLM image brings its own Ray that would have to be re-pinned anyway.
# py311 matches the project's Python; cu128 gives a CUDA 12.8 userland that vLLM's torch
# wheels run on (the node's NVIDIA driver must support CUDA 12.8).
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-cu128
FROM ${RAY_IMAGE}

# The heavy, rarely changing layer first, so a code change does not reinstall vLLM.
# Same bounds as pyproject.toml's `gpu` extra and its ray pin.
RUN pip install --no-cache-dir "vllm>=0.26,<0.34" "ray[serve]==2.60.0"

# Install from a copy of the source and delete it: a `kvtide/` folder in the working
# directory would shadow the installed package (it holds only the namespace root; the
# subpackages live in the sibling folders, mapped by pyproject.toml).
COPY --chown=ray:users . /tmp/kvtide-src
# Installs kvtide with the gpu extra; everything heavy is already satisfied above.
RUN pip install --no-cache-dir "/tmp/kvtide-src[gpu]" "ray[serve]==2.60.0" \
    && rm -rf /tmp/kvtide-src \
    && python -c "import importlib.util as u, ray; assert u.find_spec('kvtide.cluster.app'), 'kvtide.cluster.app missing'; assert ray.__version__ == '2.60.0', ray.__version__"\
    && test -x /home/ray/anaconda3/bin/kvtide-haproxy  # the chart's RAY_SERVE_HAPROXY_BINARY_PATH
WORKDIR /home/ray
# The base image's `ray` user (uid 1000) and `users` group (gid 100), numeric so the kubelet can
# check runAsNonRoot without reading /etc/passwd. The chart's podSecurityContext runs as the
# same ids with a read-only root filesystem: everything above is installed under /home/ray
# owned by this user, and what runs writes only to the volumes the chart mounts (/tmp, the
# home cache dirs, /dev/shm, the model cache).
USER 1000:100

# KubeRay generates the `ray start` command; Serve imports kvtide.cluster.app:build_app from the
# installed package. Weights go to HF_HOME, which the chart mounts (modelCache).
ENV HF_HOME=/models
