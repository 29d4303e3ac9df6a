"""specdec.rpc.clients: pool addresses as gRPC targets."""

from specdec.rpc.clients import channel_target


def test_channel_targets():
    assert channel_target("draft:50052") == "draft:50052"
    assert channel_target("dns:///draft.ns.svc:50052") == "dns:///draft.ns.svc:50052"
    assert channel_target("10.0.0.1:1, 10.0.0.2:1") == "ipv4:10.0.0.1:1,10.0.0.2:1"
    assert channel_target("localhost:1,localhost:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
