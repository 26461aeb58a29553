"""server/heap.py: the start-up heap leaves the garbage collector's scans once the server's engine is built."""
from __future__ import annotations

import gc
import weakref

from conftest import SERVED_NAME
from reliability_support import engine_config, wait_until

from specserve.server import heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_freeze_collects_garbage_first_then_freezes_the_rest():
    alive = [Node() for _ in range(1000)]
    a, b = Node(), Node()
    a.other, b.other = b, a                  # a reference cycle only the collector frees
    dead = weakref.ref(a)
    del a, b
    try:
        frozen = heap.freeze_startup_objects()
        assert dead() is None                # collected, not frozen
        now = gc.get_freeze_count()
        # a frozen object that another thread (one an earlier test left running) frees leaves the count
        assert len(alive) <= now <= frozen and frozen - now < len(alive)
        assert all(not gc.is_finalized(n) for n in alive)
    finally:
        gc.unfreeze()


def test_the_server_freezes_once_its_engine_is_built(tiny_model_dir, monkeypatch):
    from fastapi.testclient import TestClient

    from specserve.server.api import app as app_module
    calls = []
    monkeypatch.setattr(app_module, "freeze_startup_objects", lambda: calls.append(gc.get_count()) or 0)
    app = app_module.create_app(engine_config(tiny_model_dir))
    with TestClient(app) as client:
        wait_until(lambda: client.get("/health").json()["status"] != "loading", 60)
        assert client.get("/health").status_code == 200
        assert len(calls) == 1
        assert client.get("/v1/models").json()["data"][0]["id"] == SERVED_NAME
