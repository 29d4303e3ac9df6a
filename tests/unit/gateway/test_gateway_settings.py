"""GatewaySettings: the names deployments set (SPECDEC_GATEWAY_*), defaults and checks."""

from __future__ import annotations

import pytest

from gateway.settings import GatewaySettings
from specdec.settings import env_vars, load_settings


def test_names_and_defaults_the_deployments_rely_on():
    names = env_vars(GatewaySettings)
    for field in ("host", "port", "coordinator_address", "coordinator_tls_ca_file", "model_name", "request_timeout_s"):
        assert names[field] == "SPECDEC_GATEWAY_" + field.upper()
    for field in ("tls_cert_file", "tls_key_file", "otlp_endpoint"):
        assert names[field] == "SPECDEC_GATEWAY_" + field.upper()
    settings = load_settings(GatewaySettings, [], {})
    assert (settings.host, settings.port, settings.coordinator_address) == ("0.0.0.0", 8000, "localhost:50051")
    assert (settings.model_name, settings.request_timeout_s) == ("smollm2-135m-instruct", 600.0)
    assert settings.coordinator_tls_ca_file == settings.tls_cert_file == settings.otlp_endpoint == ""
    env = {"SPECDEC_GATEWAY_PORT": "9000", "SPECDEC_GATEWAY_MODEL_NAME": "other"}
    assert load_settings(GatewaySettings, ["--port", "9001"], env).port == 9001
    assert load_settings(GatewaySettings, [], env).model_name == "other"


@pytest.mark.parametrize(
    "overrides",
    [{"port": 70000}, {"model_name": ""}, {"request_timeout_s": 0}, {"tls_cert_file": "c.pem"}],
)
def test_bad_settings_are_refused_at_start(overrides):
    with pytest.raises(SystemExit):
        load_settings(GatewaySettings, [], {}, **overrides)
