"""`--metrics-compat vllm`: the vllm: names beside ours, same values, types and labels, from the text a scrape
returns (parsed with prometheus_client's own parser, as Prometheus would read it)."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.server.cli import build_parser, configs_from_args
from specserve.server.engine.stats import RequestTimings, SpecStepStats, StepStats
from specserve.server.metrics import PREFIX, VLLM_NAMES, VLLM_PREFIX, Metrics

# What routers and autoscalers configured for vLLM read (the inference gateway's endpoint picker, KEDA
# examples, vLLM's Grafana dashboard): spelled out here, not derived from VLLM_NAMES.
VLLM_READ = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
             "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens",
             "vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds",
             "vllm:e2e_request_latency_seconds", "vllm:generation_tokens")


def families(m: Metrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def busy(compat: str) -> Metrics:
    m = Metrics(compat=compat)
    m.set_model_name("m", {"none": 0, "ngram": 3})
    m.on_step(StepStats(num_running=2, num_waiting=5, kv_cache_usage=0.375, num_prompt_tokens=9,
                        num_generation_tokens=4, spec={"ngram": SpecStepStats(2, 6, 3, [2, 1, 0], [3, 2])},
                        finished=[RequestTimings("stop", 4, 5, 0.1, 0.3, 1.1, [0.2, 0.4], method="ngram")]))
    return m


def test_without_the_flag_there_is_no_vllm_name():
    assert not [name for name in families(busy("none")) if name.startswith(VLLM_PREFIX)]


def test_every_vllm_series_repeats_ours_exactly():
    fams = families(busy("vllm"))
    for ours, theirs in VLLM_NAMES.items():
        a, b = fams[PREFIX + ours], fams[VLLM_PREFIX + theirs]
        assert a.type == b.type and a.samples, ours
        renamed = [(s.name.replace(PREFIX + ours, VLLM_PREFIX + theirs, 1), s.labels, s.value) for s in a.samples]
        assert renamed == [(s.name, s.labels, s.value) for s in b.samples], ours
    assert fams["vllm:num_requests_waiting"].samples[0].value == 5
    assert fams["vllm:kv_cache_usage_perc"].samples[0].value == 0.375
    # Only the mapped families are repeated: ours that vLLM has no name for stay ours alone.
    assert "vllm:http_requests" not in fams and "vllm:spec_decode_refused" not in fams


def test_the_names_vllm_consumers_read_are_all_there():
    fams = families(busy("vllm"))
    assert [name for name in VLLM_READ if name not in fams] == []


def test_later_steps_show_in_both_names():
    m = busy("vllm")
    m.on_step(StepStats(num_waiting=1, num_generation_tokens=3))
    fams = families(m)
    assert fams["vllm:num_requests_waiting"].samples[0].value == 1
    assert fams["vllm:generation_tokens"].samples[0].value == fams["specserve:generation_tokens"].samples[0].value == 7


def test_the_flag_reaches_the_server_config_and_bad_values_are_rejected(capsys):
    args = build_parser().parse_args(["serve", "--metrics-compat", "vllm"])
    assert configs_from_args(args)[1].metrics_compat == "vllm"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-compat", "tgi"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="compat"):
        Metrics(compat="tgi")
