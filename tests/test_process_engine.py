"""ProcessEngine (`--engine-process`): the engine steps in a process of its own behind the same front end.

What must not change against the in-thread AsyncEngine: the tokens and text, the immediate 400s (checked
in this process, same messages), abort freeing the KV blocks, metrics per step, and a dead engine failing
every request instead of hanging it. Plus what is new: start-up errors cross the process boundary as the
original exception, and shutdown ends the engine process.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import httpx
import pytest
from conftest import SERVED_NAME
from reliability_support import (
    InProcessServer,
    engine_config,
    stream_events,
    wait_until,
)

from specserve.sampling.params import SamplingParams
from specserve.server.engine.async_engine import AsyncEngine
from specserve.server.engine.errors import ContextLengthError, EngineDeadError
from specserve.server.engine.process_engine import ProcessEngine
from specserve.server.engine.stats import StepStats
from specserve.speculators.base import SpecParams

PROMPT = [5, 9, 17, 5, 9, 17, 5, 9, 17, 5, 9]      # repetitive: n-gram drafts get accepted


@pytest.fixture(scope="module")
def steps() -> list[StepStats]:
    return []


@pytest.fixture(scope="module")
def proc(tiny_model_dir, steps):
    eng = ProcessEngine(engine_config(tiny_model_dir), on_step=steps.append)
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def threaded(tiny_model_dir):
    eng = AsyncEngine.from_config(engine_config(tiny_model_dir))
    yield eng
    asyncio.run(eng.shutdown())


async def _collect(engine, rid: str, prompt: list[int], params: SamplingParams, spec: SpecParams):
    tokens, text, last = [], "", None
    async for out in engine.generate(rid, prompt, params, spec):
        tokens += out.token_ids
        text += out.text
        last = out
    return tokens, text, last.finish_reason, last.spec_stats.num_accepted_tokens


@pytest.mark.parametrize("spec", [SpecParams(), SpecParams("ngram", 3)])
def test_same_output_as_the_in_thread_engine(proc, threaded, spec):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = asyncio.run(_collect(proc, f"p-{spec.method}", PROMPT, params, spec))
    want = asyncio.run(_collect(threaded, f"t-{spec.method}", PROMPT, params, spec))
    assert got == want
    assert len(got[0]) == 24 and got[2] == "length"
    if spec.method == "ngram":
        assert got[3] > 0, "the n-gram drafts were never accepted: the comparison proves little"


def test_refusals_are_immediate_and_worded_as_in_thread(proc, threaded):
    def error(engine, fn):
        with pytest.raises(ValueError) as info:
            fn(engine)
        return type(info.value), str(info.value)

    cases = [
        lambda e: e.resolve_speculation({"method": "ngram", "prompt_lookup_min": 0}),
        lambda e: e.resolve_speculation({"method": "none", "prompt_lookup_max": 2}),
        lambda e: e.resolve_speculation({"method": "ngram", "num_speculative_tokens": 99}),
        lambda e: e.resolve_speculation({"method": "eagle3"}),          # not loaded on the tiny model
        lambda e: asyncio.run(_collect(e, "long", [1] * 10_000, SamplingParams(max_tokens=4), SpecParams())),
        lambda e: asyncio.run(_collect(e, "oov", [10**9], SamplingParams(max_tokens=4), SpecParams())),
        lambda e: asyncio.run(_collect(e, "empty", [], SamplingParams(max_tokens=4), SpecParams())),
    ]
    for case in cases:
        assert error(proc, case) == error(threaded, case)
    assert error(proc, cases[4])[0] is ContextLengthError
    assert proc.num_running == 0 and proc.num_waiting == 0


def test_abort_frees_the_kv_blocks_and_steps_reach_on_step(proc, steps):
    async def two_chunks_then_leave() -> int:
        got = 0
        gen = proc.generate("leaver", PROMPT, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                            SpecParams())
        async for out in gen:
            got += len(out.token_ids)
            if got >= 2:
                break
        await gen.aclose()
        return got

    before = len(steps)
    assert asyncio.run(two_chunks_then_leave()) >= 2
    wait_until(lambda: proc.num_running == 0 and proc.num_free_kv_blocks == proc.num_kv_blocks, 15,
               lambda: f"running={proc.num_running} free={proc.num_free_kv_blocks}/{proc.num_kv_blocks}")
    new = steps[before:]
    assert new and sum(s.num_generation_tokens for s in new) >= 2
    # the abort's timings ride on the next step, here the next request's: it ended "abort", not "length"
    asyncio.run(_collect(proc, "next", PROMPT, SamplingParams(max_tokens=2), SpecParams()))
    # (on_step runs just after the outputs are handed over, so the last step's stats may trail a moment)
    wait_until(lambda: {"abort", "length"} <= {t.finish_reason for s in steps[before:] for t in s.finished}, 5,
               lambda: str([t.finish_reason for s in steps[before:] for t in s.finished]))


def test_http_through_the_engine_process(proc, tiny_model_dir):
    srv = InProcessServer(proc, tiny_model_dir)
    try:
        body = {"model": SERVED_NAME, "prompt": "one two one two one two", "max_tokens": 12, "ignore_eos": True,
                "speculation": {"method": "ngram", "num_speculative_tokens": 3}}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
        events: list = []
        stream_events(srv.url, body, events, threading.Event())
        assert events[0] == 200 and events[-1] == "[DONE]" and len(events) >= 3
        bad = httpx.post(srv.url + "/v1/completions", json={**body, "speculation": {"method": "ngram",
                         "prompt_lookup_min": 0}}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculation"
        stats = httpx.get(srv.url + "/v1/engine/stats", timeout=30)
        assert stats.status_code == 200 and stats.json()["num_kv_blocks"] == proc.num_kv_blocks
        assert stats.json()["num_free_kv_blocks"] == proc.num_kv_blocks     # nothing left behind
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    finally:
        srv.stop()


def test_a_killed_engine_process_fails_requests_instead_of_hanging(tiny_model_dir):
    eng = ProcessEngine(engine_config(tiny_model_dir))
    try:
        async def scenario():
            gen = eng.generate("victim", PROMPT, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                               SpecParams())
            await gen.__anext__()
            os.kill(eng.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass
            assert time.monotonic() - start < 10
            with pytest.raises(EngineDeadError):
                await _collect(eng, "late", PROMPT, SamplingParams(max_tokens=2), SpecParams())
        asyncio.run(scenario())
        assert eng.dead is not None and "exit code" in str(eng.dead)
        srv = InProcessServer(eng, tiny_model_dir)
        try:
            health = httpx.get(srv.url + "/health", timeout=30)
            assert health.status_code == 503 and "exit code" in health.json()["error"]
        finally:
            srv.stop()
    finally:
        asyncio.run(eng.shutdown())


def test_start_failure_is_the_original_error(tmp_path):
    from specserve.server.config import EngineConfig
    with pytest.raises(ValueError, match="no config.json"):
        ProcessEngine(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu"))


def test_shutdown_ends_the_engine_process(tiny_model_dir):
    eng = ProcessEngine(engine_config(tiny_model_dir))
    pid = eng.pid
    assert eng._proc.is_alive()
    asyncio.run(eng.shutdown())
    assert not eng._proc.is_alive() and eng._proc.exitcode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_every_method_has_a_class_to_check_its_options_without_a_model():
    # ProcessEngine checks options in the server process from the registry's classes; a method missing
    # there would turn a bad `speculation` into a KeyError (500) instead of a 400.
    from specserve.server.engine.spec_dispatch import validate_spec
    from specserve.speculators.registry import BY_NAME, METHODS
    assert set(BY_NAME) == set(METHODS) - {"none"}
    for method in BY_NAME:
        with pytest.raises(ValueError):
            validate_spec(SpecParams(method, 2, {"no_such_option": 1}))
        validate_spec(SpecParams(method, 2))


def test_structured_outputs_through_the_engine_process(proc, threaded):
    """The front end checks the constraint itself (a 400 before the pipe); the engine process compiles its
    own copy and produces the same constrained output as the in-thread engine."""
    from specserve.grammar.backend import GrammarError
    from specserve.sampling.params import StructuredSpec
    spec = StructuredSpec("regex", "[a-z]{2,6}-[0-9]{2}")
    params = SamplingParams(temperature=0.0, max_tokens=24, structured=spec)
    for engine in (proc, threaded):
        asyncio.run(engine.check_structured(spec))
        with pytest.raises(GrammarError, match="regex"):
            asyncio.run(engine.check_structured(StructuredSpec("regex", "(x")))
    got = asyncio.run(_collect(proc, "p-structured", PROMPT, params, SpecParams("ngram", 3)))
    want = asyncio.run(_collect(threaded, "t-structured", PROMPT, params, SpecParams("ngram", 3)))
    assert got == want and got[2] == "stop"
    assert re.fullmatch("[a-z]{2,6}-[0-9]{2}", got[1])
