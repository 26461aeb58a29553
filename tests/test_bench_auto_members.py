"""loadtest/bench_auto_members.py on the smallest run: every arm measured, and the restricted arm drafts with
the lookups only while `auto` keeps all its members afterwards."""
from __future__ import annotations

import pytest

from loadtest import bench_auto_members
from specserve.speculators.auto import LOOKUPS

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_bench_auto_members_smoke(monkeypatch):
    seen: list[set[str]] = []
    real = bench_auto_members.lookups_only

    def watched(eng, on):
        auto = eng.engine.spec.speculators["auto"]
        with real(eng, on):
            seen.append((on, set(auto.members)))
            yield
        seen.append(("after", set(auto.members)))
    monkeypatch.setattr(bench_auto_members, "lookups_only", bench_auto_members.contextmanager(watched))
    results = bench_auto_members.main(["--num-prompts", "1", "--new-tokens", "6", "--rounds", "1",
                                       "--sets", "prose", "--speculation-probe-tokens", "0"])
    res = results[("prose", 0.0)]
    assert set(res) == set(bench_auto_members.ARMS)
    assert all(tok_s > 0 for tok_s, _, _ in res.values()) and res["ngram"][1] == 1.0
    assert res["auto (lookups only)"][2] == 0.0                 # no drafted step on a model drafter
    full = next(m for on, m in seen if on is False)
    restricted = [m for on, m in seen if on is True]
    assert restricted and all(m == set(LOOKUPS) & full for m in restricted)
    assert full - set(LOOKUPS)                                   # the embedded family has model drafters
    assert all(m == full for on, m in seen if on == "after")
