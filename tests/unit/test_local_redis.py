"""specdec.local_redis.free_port: a free port from below the kernel's ephemeral range, so a socket
that binds port 0 or connects out cannot be handed it before its server binds it."""

from __future__ import annotations

import socket

from specdec import local_redis
from specdec.local_redis import free_port


def _bind(port: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_a_port_below_the_ephemeral_range_that_binds(tmp_path, monkeypatch):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    monkeypatch.setattr(local_redis, "_EPHEMERAL_RANGE", str(ranges))
    ports = {free_port() for _ in range(20)}
    assert all(local_redis._LOWEST_PICKED <= port < 32768 for port in ports)
    assert len(ports) > 1, "chosen at random, so two callers rarely meet"
    for port in ports:
        _bind(port)


def test_a_taken_port_is_not_chosen(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        other = free_port()
        picks = iter([port, port, other])

        class Picker:
            def randrange(self, low, high):
                return next(picks)

        monkeypatch.setattr(local_redis.random, "SystemRandom", Picker)
        assert free_port() == other


def test_without_the_range_port_zeros_choice(tmp_path, monkeypatch):
    monkeypatch.setattr(local_redis, "_EPHEMERAL_RANGE", str(tmp_path / "absent"))
    _bind(free_port())
