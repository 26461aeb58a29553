"""loadtest/bench_tp.py end to end on the smallest setting: both arms run and report what they measured."""
from loadtest import bench_tp


def test_bench_tp_measures_both_arms_and_the_collectives():
    (row,) = bench_tp.main(["--rounds", "1", "--batch", "1", "--max-tokens", "2", "--models", "embedded"])
    assert row["model"] == "embedded"
    assert row["tp1_tok_s"] > 0 and row["tp2_tok_s"] > 0
    assert row["ratio"] == row["tp2_tok_s"] / row["tp1_tok_s"]
    assert 0 < row["collective_share"] < 1
