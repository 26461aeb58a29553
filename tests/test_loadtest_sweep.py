"""loadtest.bench_spec --rounds: cells measured several times, order alternating, rounds pooled."""
import json

import pytest

from loadtest import bench_spec


def _round(tokens: int, seconds: float, drafts: float, accepted: float, per_pos: list[float], ttft: float) -> dict:
    lat = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft}
    return {"method": "ngram", "k": 2, "concurrency": 4, "temperature": 0.0, "prompt_set": "s",
            "completed": 4, "failed": 0, "duration_s": seconds, "total_output_tokens": tokens,
            "output_throughput": tokens / seconds, "request_throughput": 4 / seconds,
            "ttft_ms": lat, "tpot_ms": lat, "itl_ms": lat, "e2el_ms": lat,
            "speculation": {"ngram": {"drafts": drafts, "draft_tokens": 2 * drafts, "accepted": accepted,
                                      "acceptance_rate": accepted / (2 * drafts),
                                      "mean_acceptance_length": 1 + accepted / drafts}},
            "per_pos": per_pos}


def test_pool_rounds_weighs_by_time_and_drafts():
    a = _round(100, 1.0, drafts=10, accepted=10, per_pos=[0.8, 0.2], ttft=10.0)
    b = _round(100, 3.0, drafts=30, accepted=15, per_pos=[0.4, 0.1], ttft=30.0)
    p = bench_spec.pool_rounds([a, b])
    assert p["output_throughput"] == pytest.approx(200 / 4.0)          # not the mean of 100 and 33.3
    assert p["request_throughput"] == pytest.approx(8 / 4.0) and p["completed"] == 8
    spec = p["speculation"]["ngram"]
    assert spec["drafts"] == 40 and spec["mean_acceptance_length"] == pytest.approx(1 + 25 / 40)
    assert spec["acceptance_rate"] == pytest.approx(25 / 80)
    assert p["per_pos"] == pytest.approx([(10 * 0.8 + 30 * 0.4) / 40, (10 * 0.2 + 30 * 0.1) / 40])
    assert p["ttft_ms"]["p99"] == pytest.approx(20.0) and p["rounds"] == [a, b]
    assert bench_spec.pool_rounds([a]) is a


def test_pool_rounds_of_plain_rows_has_no_acceptance():
    a, b = _round(50, 1.0, 1, 1, [], 1.0), _round(50, 1.0, 1, 1, [], 1.0)
    for r in (a, b):
        r.update(method="none", k=0, speculation={})
    p = bench_spec.pool_rounds([a, b])
    assert p["speculation"] == {} and p["per_pos"] == [] and p["output_throughput"] == pytest.approx(50.0)


def test_by_cell_groups_points_in_grid_order():
    pts = [("none", 0, 1, 0.0, "s"), ("ngram", 2, 1, 0.0, "s"), ("none", 0, 2, 0.0, "s"), ("ngram", 2, 2, 0.0, "s")]
    assert bench_spec.by_cell(pts) == [pts[:2], pts[2:]]


def test_sweep_with_rounds_against_the_server(server_url, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_spec, "RESULTS", tmp_path)
    bench_spec.main(["--url", server_url, "--methods", "ngram", "--ks", "2", "--concurrency", "1",
                     "--temperatures", "0", "--prompt-sets", "code_editing", "--max-tokens", "8",
                     "--min-prompts", "2", "--prompts-per-slot", "1", "--rounds", "2"])
    (out,) = tmp_path.iterdir()
    res = json.loads((out / "results.json").read_text())["results"]
    assert [r["method"] for r in res] == ["none", "ngram"]
    for r in res:
        assert len(r["rounds"]) == 2 and r["completed"] == 4
        assert r["total_output_tokens"] == sum(x["total_output_tokens"] for x in r["rounds"])
        assert r["output_throughput"] == pytest.approx(
            r["total_output_tokens"] / sum(x["duration_s"] for x in r["rounds"])
        )
    # the second round runs the cell backwards: ngram first
    progress = [line.split("] ")[1].split()[0] for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert progress == ["none", "ngram", "ngram", "none"]


def test_paired_baselines_run_every_arm_on_every_prompt_in_alternating_order(tiny_model_dir, server_url, tmp_path):
    """loadtest.bench_paired: HF, ours through HTTP and ours offline on the same prompt back to back, the order
    reversed on the next prompt; pooled rows feed bench_baselines' ratio tables."""
    from loadtest import bench_baselines as bb
    from loadtest import bench_paired as bp

    (tmp_path / "target").symlink_to(tiny_model_dir)
    import httpx

    model = httpx.get(f"{server_url}/v1/models").json()["data"][0]["id"]
    runs = bp.arms(
        server_url,
        model,
        bb.hf_models(tmp_path, 3, "float32"),
        bb.offline_engine(tmp_path, 1, "float32"),
        ["ngram"],
        ["none", "ngram"],
        k=3,
        max_tokens=6,
    )
    assert list(runs) == [
        ("hf", "plain"),
        ("hf", "prompt_lookup"),
        ("ours", "none"),
        ("ours", "ngram"),
        ("ours-offline", "none"),
        ("ours-offline", "ngram"),
    ]
    lines: list[str] = []
    rows, per_request = bp.run_paired(runs, ["code_completion"], 2, rounds=1, log=lines.append)
    assert len(per_request) == 12 and len(lines) == 2
    first = [(r["who"], r["method"]) for r in per_request if r["prompt"] == 0]
    second = [(r["who"], r["method"]) for r in per_request if r["prompt"] == 1]
    assert first == list(runs) and second == first[::-1]
    assert all(r["output_tokens"] == 6 and r["seconds"] > 0 for r in per_request)
    pooled = {(r["who"], r["method"]): r for r in rows}
    assert pooled[("ours", "ngram")]["tok_per_s"] == pytest.approx(
        12 / sum(r["seconds"] for r in per_request if (r["who"], r["method"]) == ("ours", "ngram"))
    )
    table = {r["hf"]: r for r in bb.ratios(rows)}
    assert table["prompt_lookup"]["ours_same"] == "ngram"
    spread = bp.prompt_spread(per_request, ("ours", "ngram"), "prompt_lookup")["code_completion"]
    assert len(spread) == 2 and all(v > 0 for v in spread)


def test_server_ab_runs_each_config_and_the_offline_engine(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """loadtest.bench_server_ab: one server per --config (here in-thread and --engine-process), every method on
    each, the offline engine as reference; ratios to it per prompt set and method."""
    from loadtest import bench_server_ab as ab

    models = tmp_path / "models"
    models.mkdir()
    (models / "target").symlink_to(tiny_model_dir)
    monkeypatch.setattr(ab, "RESULTS", tmp_path / "results")
    ab.main(
        [
            "--models",
            str(models),
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--prompts",
            "2",
            "--rounds",
            "1",
            "--max-tokens",
            "4",
            "--k",
            "2",
            "--prompt-sets",
            "code_completion",
            "--methods",
            "none,ngram",
            "--config",
            "thread=",
            "--config",
            "process=--engine-process",
        ]
    )
    data = json.loads(next((tmp_path / "results").glob("server-ab-*/results.json")).read_text())
    assert data["meta"]["configs"] == {"thread": [], "process": ["--engine-process"]}
    arms = {(r["who"], r["method"]) for r in data["rows"]}
    assert arms == {(w, m) for w in ("thread", "process", "offline") for m in ("none", "ngram")}
    assert len(data["per_request"]) == 2 * 6 and all(r["output_tokens"] == 4 for r in data["per_request"])
    offline = {r["method"]: r["tok_per_s"] for r in data["rows"] if r["who"] == "offline"}
    for r in data["rows"]:
        assert r["vs_offline"] == pytest.approx(r["tok_per_s"] / offline[r["method"]]) and r["vs_offline"] > 0
    assert "÷ offline" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["noequals", "=--flag", "offline=--x"])
def test_server_ab_config_must_be_name_equals_flags(bad):
    import argparse

    from loadtest.bench_server_ab import parse_config

    assert parse_config("p=--engine-process --num-threads 1") == ("p", ["--engine-process", "--num-threads", "1"])
    assert parse_config("plain=") == ("plain", [])
    with pytest.raises(argparse.ArgumentTypeError):
        parse_config(bad)
