def test_redis_is_real(redis_client):
    info = redis_client.info("server")
    assert info["redis_version"]
    redis_client.set("specdec:test:probe", b"1", ex=5)
    assert redis_client.get("specdec:test:probe") == b"1"
