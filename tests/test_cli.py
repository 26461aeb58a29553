"""The CLI documents and wires every config field (the field list comes from the dataclasses)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.server.api.limits import Limits
from specserve.server.cli import build_parser, configs_from_args, flag_for, main
from specserve.server.config import EngineConfig, ServerConfig

CONFIGS = (EngineConfig, ServerConfig, Limits)
FIELDS = [(cls, f.name) for cls in CONFIGS for f in dataclasses.fields(cls)]


def serve_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["serve"]


def test_every_config_field_has_a_documented_flag():
    actions = {opt: a for a in serve_parser()._actions for opt in a.option_strings}
    help_text = serve_parser().format_help()
    for cls, name in FIELDS:
        flag = flag_for(name)
        assert flag in actions, f"{cls.__name__}.{name} has no flag {flag}"
        assert flag in help_text
        doc = actions[flag].help or ""
        assert "default" in doc.lower(), f"help of {flag} does not say its default"


def test_help_via_python_m_server():
    out = subprocess.run([sys.executable, "-m", "specserve.server", "serve", "--help"], capture_output=True,
                         text=True, timeout=60, check=False,
                         env={"SPECSERVE_API_KEY": "do-not-print-me", "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert "--max-speculative-tokens" in out.stdout and "do-not-print-me" not in out.stdout


def test_flags_become_configs(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    args = serve_parser().parse_args([
        "--model", "/m", "--served-model-name", "m", "--dtype", "float32", "--device", "cpu",
        "--block-size", "32", "--kv-cache-memory-gb", "0.5", "--max-model-len", "256", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "512", "--max-speculative-tokens", "6", "--draft-model", "/d",
        "--eagle3", "/e", "--no-prefix-caching", "--seed", "3", "--num-threads", "2", "--host", "0.0.0.0",
        "--port", "9", "--api-key", "k", "--log-level", "debug", "--max-n", "3", "--max-logprobs", "4",
        "--max-stop", "5", "--max-stop-len", "6", "--max-logit-bias", "7", "--max-prompts", "8",
        "--max-messages", "9", "--speculation", '{"method": "ngram", "num_speculative_tokens": 5}'])
    engine, server, limits = configs_from_args(args)
    assert engine.model == "/m" and engine.served_model_name == "m" and engine.dtype == "float32"
    assert (engine.block_size, engine.kv_cache_memory_gb, engine.max_model_len) == (32, 0.5, 256)
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.max_speculative_tokens) == (4, 512, 6)
    assert (engine.draft_model, engine.eagle3, engine.enable_prefix_caching) == ("/d", "/e", False)
    assert (engine.seed, engine.num_threads, engine.device) == (3, 2, "cpu")
    assert (engine.speculation.method, engine.speculation.num_speculative_tokens) == ("ngram", 5)
    assert server == ServerConfig(host="0.0.0.0", port=9, api_key="k", log_level="debug")
    assert limits == Limits(3, 4, 5, 6, 7, 8, 9)


def test_defaults_match_the_dataclasses(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    engine, server, limits = configs_from_args(serve_parser().parse_args([]))
    assert (engine, server, limits) == (EngineConfig(), ServerConfig(), Limits())
    monkeypatch.setenv("SPECSERVE_API_KEY", "from-env")
    assert configs_from_args(serve_parser().parse_args([]))[1].api_key == "from-env"


@pytest.mark.parametrize("argv", [["--speculation", "{not json"], ["--speculation", '{"method": "warp"}'],
                                  ["--block-size", "3"], ["--max-n", "0"], ["--port", "70000"],
                                  ["--speculation", '{"method": "ngram", "prompt_lookup_min": 0}'],
                                  ["--speculation", '{"method": "eagle3", "depth": 2}']])
def test_bad_flags_exit_2_with_a_message(argv, capsys):
    assert main(["serve", *argv]) == 2
    assert "error" in capsys.readouterr().err


def test_the_server_leaves_the_openmp_wait_policy_to_libgomp():
    """No OMP_WAIT_POLICY of our own: PASSIVE cost 1.4-1.7x at batch 1 once the builder's worker pool is
    released (server/engine/omp_pool.py). Importing the CLI must not load torch either."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import os, sys, specserve.server.cli; print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent)
    assert out.stdout.split() == ["False", "None"]
