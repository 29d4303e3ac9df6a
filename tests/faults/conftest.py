"""Fault-injection fixtures: one draft and one target process and one coordinator process (API
keys on) shared by the package's tests whose faults leave them intact; process logs in a failed
test's report."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from faults import fault_harness as harness

KEYS, PREFIX = harness.KEYS, harness.SHARED_PREFIX


@dataclass
class Pools:
    draft: harness.Service
    target: harness.Service


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for service in harness.LIVE:
            report.sections.append((f"log of {service.name} ({service.log_path})", service.log_tail()))


@pytest.fixture(scope="package")
def fault_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="package")
def pools(tiny_model_dirs, fault_dir):
    draft = harness.model_service("draft", tiny_model_dirs["draft"], fault_dir)
    target = harness.model_service("target", tiny_model_dirs["target"], fault_dir)
    with harness.running(draft, target):
        yield Pools(draft, target)


@pytest.fixture(scope="package")
def keys_file(fault_dir):
    path = fault_dir / "api-keys"
    path.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    return path


@pytest.fixture(scope="package")
def shared_settings(pools, redis_url, tiny_model_dirs, keys_file):
    """Settings of a coordinator on the shared pools and Redis, API keys on (any number of replicas)."""
    return {
        "draft_address": pools.draft.address,
        "target_address": pools.target.address,
        "redis_url": redis_url,
        "tokenizer": tiny_model_dirs["target"],
        "SESSION_KEY_PREFIX": PREFIX,
        "API_KEYS_FILE": str(keys_file),
        # The soak's 16 streams at once (below MAX_WORKERS 64); the pods admit 48.
        "MAX_CONCURRENT_REQUESTS": "16",
    }


@pytest.fixture(scope="package")
def shared_coordinator(shared_settings, fault_dir):
    service = harness.coordinator(fault_dir, **shared_settings)
    with harness.running(service):
        yield service
