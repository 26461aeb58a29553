"""loadtest.serve: metric definitions (vLLM bench serve's) and a short real run against the server."""
import pytest

from loadtest import serve
from loadtest.serve_metrics import (
    RequestRecord,
    parse_spec_counters,
    percentiles,
    spec_delta,
    summarize,
)


def test_percentiles_interpolate_like_numpy():
    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert p["mean"] == 2.5 and p["p50"] == 2.5 and p["p90"] == pytest.approx(3.7)


def test_tpot_excludes_first_token_and_itl_pools_gaps():
    a = RequestRecord(ok=True, ttft=0.5, e2el=1.5, itl=[0.25, 0.75], output_tokens=5)
    b = RequestRecord(ok=True, ttft=0.2, e2el=0.2, itl=[], output_tokens=1)
    c = RequestRecord(ok=False, error="boom")
    s = summarize([a, b, c], duration=2.0, slos={"ttft": 300})
    assert a.tpot == pytest.approx(0.25) and b.tpot is None
    assert s["tpot_ms"]["mean"] == pytest.approx(250)          # b has no TPOT
    assert s["itl_ms"]["mean"] == pytest.approx(500)           # pooled gaps of all requests
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["boom"]
    assert s["output_throughput"] == 3.0 and s["goodput"] == 0.5   # only b meets TTFT <= 300 ms


def test_spec_counters_from_scrape():
    text = '\n'.join([
        '# HELP specserve:spec_decode_num_drafts_total x',
        'specserve:spec_decode_num_drafts_total{method="ngram",model_name="m"} 10.0',
        'specserve:spec_decode_num_draft_tokens_total{method="ngram",model_name="m"} 40.0',
        'specserve:spec_decode_num_accepted_tokens_total{method="ngram",model_name="m"} 20.0',
    ])
    after = parse_spec_counters(text)
    d = spec_delta({"ngram": {"drafts": 5, "draft_tokens": 20, "accepted": 5}}, after)
    assert d["ngram"]["acceptance_rate"] == pytest.approx(15 / 20)
    assert d["ngram"]["mean_acceptance_length"] == pytest.approx(1 + 15 / 5)


def test_short_run_against_the_real_server(server_url, tmp_path, capsys):
    out = tmp_path / "res.json"
    serve.main(["--url", server_url, "--method", "ngram", "--k", "3", "--concurrency", "1,3",
                "--num-prompts", "6", "--max-tokens", "16", "--quiet", "--output-json", str(out),
                "--goodput", "e2el:600000"])
    import json
    res = json.loads(out.read_text())
    assert [r["concurrency"] for r in res] == [1, 3]
    for r in res:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["total_output_tokens"] > 0 and r["goodput"] == pytest.approx(r["request_throughput"])
        assert "ngram" in r["speculation"] and r["speculation"]["ngram"]["draft_tokens"] > 0
    assert "concurrency" in capsys.readouterr().out


def test_baselines_hf_and_ours_side_by_side(tiny_model_dir, server_url, tmp_path):
    """loadtest.bench_baselines: HF generate rows (plain, prompt lookup) and our rows on the same prompts,
    with exactly max_tokens new tokens each, and the ours/HF ratio table built from them."""
    from loadtest import bench_baselines as bb
    (tmp_path / "target").symlink_to(tiny_model_dir)
    hf = bb.hf_rows(tmp_path, ["code_completion"], 2, 8, 3, "float32")
    assert [r["method"] for r in hf] == ["plain", "prompt_lookup"]      # no draft dir: no assisted row
    assert all(r["output_tokens"] == 16 and r["tok_per_s"] > 0 for r in hf)
    ours = bb.our_rows(server_url, ["code_completion"], 2, 8, 3, ["ngram"])
    assert [r["method"] for r in ours] == ["none", "ngram"] and all(r["failures"] == 0 for r in ours)
    assert all(r["output_tokens"] == 16 and r["tok_per_s"] == pytest.approx(16 / r["seconds"], rel=1e-6)
               for r in ours)
    table = bb.ratios(hf + ours)
    by_mode = {r["hf"]: r for r in table}
    assert by_mode["plain"]["ours_same"] == "none" and by_mode["prompt_lookup"]["ours_same"] == "ngram"
    ours_tps = {r["method"]: r["tok_per_s"] for r in ours}
    assert by_mode["plain"]["ratio_same"] == pytest.approx(ours_tps["none"] / hf[0]["tok_per_s"])
    assert by_mode["plain"]["ratio_best"] == pytest.approx(max(ours_tps.values()) / hf[0]["tok_per_s"])
    offline = bb.offline_rows(bb.offline_engine(tmp_path, 1, "float32"), ["code_completion"], 2, 8, 3,
                              ("none", "ngram"))
    assert [(r["who"], r["method"], r["output_tokens"]) for r in offline] == [("ours-offline", "none", 16),
                                                                              ("ours-offline", "ngram", 16)]
    assert bb.ratios(hf + ours + offline) == table                       # offline rows are not HTTP rows
    engine_alone = {r["hf"]: r for r in bb.ratios(hf + ours + offline, who="ours-offline")}
    assert engine_alone["prompt_lookup"]["ours_same"] == "ngram"
    assert engine_alone["prompt_lookup"]["ratio_same"] == pytest.approx(offline[1]["tok_per_s"] / hf[1]["tok_per_s"])
    (line,) = bb.serving_cost(ours + offline)
    assert line.endswith(f"= {ours_tps['none'] / offline[0]['tok_per_s']:.2f}")


def test_baseline_rounds_pool_tokens_and_seconds():
    """bench_baselines --rounds: each (who, method, set) row pools its rounds' tokens and seconds, so a slow
    round weighs by its time, not by a mean of ratios; acceptance is averaged and failures summed."""
    from loadtest import bench_baselines as bb
    rows = [{"who": "hf", "method": "plain", "prompt_set": "s", "output_tokens": 100, "seconds": 1.0, "round": 0},
            {"who": "hf", "method": "plain", "prompt_set": "s", "output_tokens": 100, "seconds": 3.0, "round": 1},
            {"who": "ours", "method": "ngram", "prompt_set": "s", "output_tokens": 100, "seconds": 0.5,
             "mean_acceptance_length": 2.0, "failures": 0, "round": 0},
            {"who": "ours", "method": "ngram", "prompt_set": "s", "output_tokens": 100, "seconds": 1.5,
             "mean_acceptance_length": 3.0, "failures": 1, "round": 1}]
    pooled = {r["who"]: r for r in bb.pool_rounds(rows)}
    assert pooled["hf"]["tok_per_s"] == pytest.approx(200 / 4.0) and pooled["hf"]["rounds"] == 2
    assert pooled["ours"]["tok_per_s"] == pytest.approx(200 / 2.0)
    assert pooled["ours"]["mean_acceptance_length"] == pytest.approx(2.5) and pooled["ours"]["failures"] == 1
    (row,) = [r for r in bb.ratios(list(pooled.values())) if r["hf"] == "plain"]
    assert row["ratio_best"] == pytest.approx(100 / 50)


@pytest.mark.filterwarnings("error::UserWarning")     # e.g. matplotlib's empty-legend warning
def test_spec_sweep_writes_results_table_and_plots(server_url, tmp_path, monkeypatch):
    """loadtest.bench_spec against a running server: every grid point measured, a speedup table whose
    `none` rows carry absolute tok/s and whose ngram rows carry a ratio and τ, and the three PNG plots."""
    import json

    from loadtest import bench_spec
    monkeypatch.setattr(bench_spec, "RESULTS", tmp_path)
    bench_spec.main(["--url", server_url, "--methods", "ngram", "--ks", "2", "--concurrency", "1,2",
                     "--temperatures", "0", "--prompt-sets", "code_editing", "--max-tokens", "8",
                     "--min-prompts", "2", "--prompts-per-slot", "1"])
    (out,) = tmp_path.iterdir()
    res = json.loads((out / "results.json").read_text())["results"]
    assert [(r["method"], r["concurrency"]) for r in res] == [("none", 1), ("ngram", 1), ("none", 2), ("ngram", 2)]
    assert all(r["completed"] == 2 and r["failed"] == 0 for r in res)     # max(min_prompts, c x per slot)
    table = (out / "table.md").read_text().splitlines()
    assert table[0] == "| prompt set | T | method | k | c=1 | c=2 |"
    assert table[2].startswith("| code_editing | 0.0 | none | 0 | ") and "tok/s" in table[2]
    import re
    assert table[3].startswith("| code_editing | 0.0 | ngram | 2 | ")
    for cell, r in zip(table[3].split(" | ")[4:], [r for r in res if r["method"] == "ngram"]):
        ratio = r["output_throughput"] / next(b["output_throughput"] for b in res
                                              if b["method"] == "none" and b["concurrency"] == r["concurrency"])
        tau = r["speculation"].get("ngram", {}).get("mean_acceptance_length")   # absent when nothing was drafted
        assert re.fullmatch(rf"{ratio:.2f}x" + (rf" \(τ {tau:.2f}\)" if tau else "") + r"( \|)?", cell), cell
    for png in ("speedup_vs_concurrency.png", "acceptance_length.png", "per_position_acceptance.png"):
        assert (out / png).stat().st_size > 1000


def test_spec_grid_runs_prediction_only_where_prompts_carry_one():
    from types import SimpleNamespace

    from loadtest.bench_spec import grid
    args = SimpleNamespace(temperatures=[0.0], prompt_sets=["code_completion", "code_editing"], concurrency=[1],
                           ks=[2, 4])
    points = list(grid(args, ["ngram", "prediction"]))
    assert ("prediction", 2, 1, 0.0, "code_editing") in points
    assert not [p for p in points if p[0] == "prediction" and p[4] == "code_completion"]
    assert len(points) == 2 * (1 + 2) + 2          # per set: none + ngram x 2 k; code_editing: + prediction x 2 k


def test_vllm_comparison_table_pairs_rows_by_server_method_and_concurrency():
    from loadtest.bench_vllm import labelled, ratio_table
    sent = {"method": "off", "concurrency": 1, "prompt_set": "code_editing",   # what the client returns for vLLM
            "output_throughput": 40.0}
    rows = [labelled(sent, "vllm", "ngram"), labelled({**sent, "output_throughput": 30.0}, "vllm", "none"),
            labelled({**sent, "method": "ngram", "output_throughput": 60.0}, "ours", "ngram"),
            labelled({**sent, "method": "none", "output_throughput": 33.0}, "ours", "none"),
            labelled({**sent, "method": "hybrid", "output_throughput": 80.0}, "ours", "hybrid")]
    assert rows[0]["method"] == "ngram" and rows[0]["server"] == "vllm"
    table = ratio_table(rows, [1])
    assert [t["method"] for t in table] == ["ngram", "none", "best"]
    assert [t["ratio"] for t in table] == pytest.approx([1.5, 1.1, 2.0])      # best: hybrid 80 ÷ vLLM ngram 40
    assert table[2]["best_of"] == {"ours": "hybrid", "vllm": "ngram"}
    other = [{**r, "prompt_set": "code_completion", "output_throughput": r["output_throughput"] * (2 if
              r["server"] == "ours" else 1)} for r in rows]
    table = ratio_table(rows + other, [1])                      # sets are paired within themselves
    assert [(t["prompt_set"], t["method"]) for t in table] == [
        ("code_completion", "ngram"),
        ("code_completion", "none"),
        ("code_completion", "best"),
        ("code_editing", "ngram"),
        ("code_editing", "none"),
        ("code_editing", "best"),
    ]
    assert [t["ratio"] for t in table] == pytest.approx([3.0, 2.2, 4.0, 1.5, 1.1, 2.0])


def test_step_profile_accounts_for_each_stage(tiny_model_dir, capsys):
    """loadtest.profile_step on the tiny model: none first and last, every stage timed, stages within the step."""
    from loadtest import profile_step

    results = profile_step.main(
        [
            "--model",
            str(tiny_model_dir),
            "--methods",
            "ngram",
            "--k",
            "2",
            "--concurrency",
            "3",
            "--max-tokens",
            "6",
            "--temperature",
            "0.8",
            "--kv-cache-memory-gb",
            "0.02",
        ]
    )
    assert [r["method"] for r in results] == ["none", "ngram", "none"]
    for r in results:
        assert r["steps"] > 0 and r["tok_per_s"] > 0
        assert {"forward", "logits", "sampler", "prepare", "emit"} <= set(r["stages"])
        assert sum(r["stages"].values()) <= r["ms_per_step"] * 1.01  # stages are inside the step
    assert results[1]["stages"].get("propose", 0) > 0 and "ms/step" in capsys.readouterr().out


def test_interleaved_ab_pairs_every_prompt_and_keeps_greedy_output(tiny_model_dir, capsys):
    """loadtest.bench_interleaved on the tiny model: one row per (method, k), both arms over the same tokens,
    per-round ratios bracketing the pooled speedup, and fp32 greedy output equal to plain in every pair."""
    from loadtest import bench_interleaved

    rows = bench_interleaved.main(
        [
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--methods",
            "ngram",
            "--ks",
            "1,3",
            "--num-prompts",
            "3",
            "--new-tokens",
            "8",
            "--rounds",
            "2",
        ]
    )
    assert [(r["method"], r["k"]) for r in rows] == [("ngram", 1), ("ngram", 3)]
    for r in rows:
        assert r["greedy_mismatches"] == 0 and r["tau"] >= 1.0
        assert r["ratio_min"] <= r["speedup"] <= r["ratio_max"]
        assert r["tok_s"] / r["none_tok_s"] == pytest.approx(r["speedup"])
    assert "interleaved rounds" in capsys.readouterr().out


def test_vllm_gets_intel_openmp_preloaded_when_its_venv_has_it(tmp_path):
    from loadtest.bench_vllm import vllm_env

    python = tmp_path / "bin" / "python"
    env = vllm_env(str(python), 2, base={"LD_PRELOAD": "/x.so"})
    assert "LD_PRELOAD" in env and env["LD_PRELOAD"] == "/x.so" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    env = vllm_env(str(python), 2, base={})
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so") and env["OMP_NUM_THREADS"] == "2"
