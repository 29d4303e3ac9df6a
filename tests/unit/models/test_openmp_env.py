"""The OpenMP defaults the model services set before torch loads (`specdec.models.openmp_env`)."""

from __future__ import annotations

import os

from specdec.models import openmp_env


def test_defaults_fill_what_the_environment_leaves_unset(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(openmp_env, "available_cpus", lambda: 3)
    openmp_env.set_openmp_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == openmp_env.GOMP_SPINCOUNT_DEFAULT == "50000"
    assert os.environ["OMP_NUM_THREADS"] == "3"


def test_values_already_in_the_environment_win(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    openmp_env.set_openmp_defaults()
    assert (os.environ["GOMP_SPINCOUNT"], os.environ["OMP_NUM_THREADS"]) == ("10000", "1")


def test_cgroup_quota_v2_then_v1(tmp_path):
    v2 = tmp_path / "cpu.max"
    v1 = tmp_path / "v1"
    v1.mkdir()
    v2.write_text("150000 100000\n")
    assert openmp_env.cgroup_cpu_limit(v2, v1) == 1.5
    v2.write_text("max 100000\n")
    assert openmp_env.cgroup_cpu_limit(v2, v1) is None
    v2.unlink()
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert openmp_env.cgroup_cpu_limit(v2, v1) == 2.0
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert openmp_env.cgroup_cpu_limit(v2, v1) is None
