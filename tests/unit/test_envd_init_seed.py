"""The node sends every envd /init a fresh 64-byte entropySeed (restored guests share RNG state)."""
import base64

import httpx

from nodes import tasks


def test_init_envd_sends_a_fresh_seed(monkeypatch):
    bodies = []

    def fake_post(url, json, headers, timeout):
        bodies.append(json)
        return httpx.Response(204)

    monkeypatch.setattr(tasks.httpx, "post", fake_post)
    tasks._init_envd("127.0.0.1", 1, {"A": "1"}, None)
    tasks._init_envd("127.0.0.1", 1, {}, "tok")
    seeds = [base64.b64decode(b["entropySeed"], validate=True) for b in bodies]
    assert [len(s) for s in seeds] == [64, 64]
    assert seeds[0] != seeds[1]
