"""coordinator.auth: the keys file's format, reloads that keep the last good keys, no key in any message."""

from __future__ import annotations

import logging
import os

import pytest

from coordinator.auth import ApiKeys, Unauthenticated, default_tenant, parse_keys


def bearer(key: str) -> list[tuple[str, str]]:
    return [("user-agent", "test"), ("authorization", f"Bearer {key}")]


def test_lines_are_key_and_optional_tenant_with_comments_and_blank_lines_skipped():
    tenants = parse_keys("# comment\n\n  alpha  team-a \nbeta # trailing comment\n\tgamma team-a\n")
    assert sorted(tenants.values()) == sorted(["team-a", "team-a", default_tenant("beta")])
    assert not any(k in tenants for k in ("alpha", "beta", "gamma"))  # digests only, never the keys


def test_a_key_without_a_tenant_is_its_own_stable_tenant_that_does_not_reveal_it():
    assert default_tenant("beta") == default_tenant("beta") != default_tenant("beta2")
    assert "beta" not in default_tenant("beta")


def test_a_malformed_line_names_its_number_not_its_key():
    with pytest.raises(ValueError, match="line 2") as error:
        parse_keys("ok tenant\nsecret-key tenant extra\n")
    assert "secret-key" not in str(error.value)


def test_tenant_of(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alpha team-a\nbeta\n")
    keys = ApiKeys(str(path))
    assert keys.tenant_of(bearer("alpha")) == "team-a"
    assert keys.tenant_of(bearer("beta")) == default_tenant("beta")
    for metadata, message in [(None, "missing"), ([("authorization", "alpha")], "missing"), (bearer("x"), "unknown")]:
        with pytest.raises(Unauthenticated, match=message):
            keys.tenant_of(metadata)
    assert Unauthenticated.code == "UNAUTHENTICATED"


def test_no_keys_file_means_no_authentication():
    assert ApiKeys("").tenant_of(None) == ""


def test_an_unreadable_file_at_start_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        ApiKeys(str(tmp_path / "missing"))


def test_reloads_on_change_and_keeps_the_last_good_keys_when_the_file_breaks_or_goes(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("alpha team-a\n")
    keys = ApiKeys(str(path))
    path.write_text("alpha team-a\nbeta team-b\n")
    assert keys.tenant_of(bearer("beta")) == "team-b"
    with caplog.at_level(logging.WARNING, logger="coordinator.auth"):
        path.write_text("alpha team-a too-many-fields\n")
        assert keys.tenant_of(bearer("beta")) == "team-b"
        os.remove(path)
        assert keys.tenant_of(bearer("alpha")) == "team-a"
    assert len([r for r in caplog.records if "not reloaded" in r.getMessage()]) == 2  # once per change
    assert "alpha" not in caplog.text and "beta" not in caplog.text
    path.write_text("gamma team-c\n")
    assert keys.tenant_of(bearer("gamma")) == "team-c"
    with pytest.raises(Unauthenticated):
        keys.tenant_of(bearer("alpha"))
