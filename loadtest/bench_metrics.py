"""Metrics overhead: engine steps per second with the Prometheus sinks on vs off, side by side.

One engine, one workload (a mixed batch: plain, n-gram and prediction requests at different k, each
finishing with its timings booked), run alternately without and with `Metrics.on_step` after every
step. The "on" arm also renders the registry once per second of wall time, as a 1 s Prometheus scrape
would. Each round runs both arms, in alternating order, so drift on a shared machine hits both; the
reported ratio is the median over rounds of steps/s(on) / steps/s(off), per wall second and per CPU
second of this process (less disturbed by other work on a shared machine). Target: >= 0.98.
On a busy machine that ratio is noisy, so the cost of `on_step` alone is also measured (a run's real
StepStats replayed into a fresh registry) and set against the step time.

Run: python -m loadtest.bench_metrics [--size tiny|30m] [--rounds 21] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from typing import Any

import torch

from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.metrics import Metrics
from specserve.speculators.base import SpecParams

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024}


class MeteredEngine:
    """Engine proxy: counts steps and, when `metrics` is set, hands each step's stats to it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.metrics: Metrics | None = None
        self.steps = 0
        self.recorded: list | None = None             # StepStats of a run, for on_step_cost()
        self._last_scrape = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def step(self):
        outputs, stats = self.engine.step()
        self.steps += 1
        if self.recorded is not None:
            self.recorded.append(stats)
        if self.metrics is not None:
            self.metrics.on_step(stats)
            now = time.perf_counter()
            if now - self._last_scrape >= 1.0:         # a 1 s scrape interval
                self.metrics.render()
                self._last_scrape = now
        return outputs, stats


def make_checkpoint(path: str, size: str, vocab: int) -> None:
    from loadtest import bench_decode
    if size == "30m":
        bench_decode.make_checkpoint(path, vocab)
        return
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specserve.server.models.embedded import require as embedded_family
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **TINY)).save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(embedded_family().tokenizer)).save_pretrained(path)


def workload(vocab: int, batch: int, new: int):
    """Prompts, params, speculation and predictions for a mixed batch (none / ngram / prediction)."""
    g = torch.Generator().manual_seed(0)
    prompts, specs, preds = [], [], []
    for i in range(batch):
        base = torch.randint(0, vocab, (8,), generator=g).tolist()
        prompts.append(base * 4)                       # repetitive: the n-gram speculator finds drafts
        kind = i % 3
        specs.append([SpecParams(), SpecParams("ngram", 2 + i % 5), SpecParams("prediction", 4)][kind])
        preds.append(base * 8 if kind == 2 else None)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    return prompts, params, specs, preds


def run_arm(eng: LLM, metered: MeteredEngine, metrics: Metrics | None, load) -> tuple[float, float]:
    """(steps per wall second, steps per CPU second of this process)."""
    metered.metrics = metrics
    metered.steps = 0
    t, cpu = time.perf_counter(), time.process_time()
    eng.generate(*load[:2], speculation=load[2], predictions=load[3])
    return metered.steps / (time.perf_counter() - t), metered.steps / (time.process_time() - cpu)


def on_step_cost(recorded: list, methods: list[str], repeats: int = 50) -> float:
    """Seconds per Metrics.on_step, replaying a run's real StepStats into a fresh registry."""
    metrics = Metrics()
    metrics.set_model_name("bench", dict.fromkeys(methods, 8))
    t = time.perf_counter()
    for _ in range(repeats):
        for stats in recorded:
            metrics.on_step(stats)
    return (time.perf_counter() - t) / (repeats * len(recorded))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("tiny", "30m"), default="tiny",
                    help="tiny (2 layers, 64 wide: the cheapest steps, the worst case for overhead) or 30m")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from specserve.server.engine.tokenizer import Tokenizer
    from specserve.server.models.embedded import require as embedded_family
    vocab = Tokenizer(str(embedded_family().tokenizer)).vocab_size
    with tempfile.TemporaryDirectory() as path:
        make_checkpoint(path, args.size, vocab)
        cfg = EngineConfig(model=path, served_model_name="bench", dtype="float32", device=args.device,
                           kv_cache_memory_gb=0.25, num_threads=args.num_threads)
        base = LLM(config=cfg)
        metered = MeteredEngine(base.engine)
        eng = LLM.from_engine(metered)
        metrics = Metrics()
        metrics.set_model_name("bench", {m: cfg.max_speculative_tokens for m in base.engine.spec.methods})
        load = workload(vocab, args.batch, args.new_tokens)
        run_arm(eng, metered, metrics, load)           # warm-up, both paths
        run_arm(eng, metered, None, load)
        off, on = [], []
        for r in range(args.rounds):                   # off-on, on-off, ...: neither arm always goes first
            for arm in ((None, metrics) if r % 2 == 0 else (metrics, None)):
                (off if arm is None else on).append(run_arm(eng, metered, arm, load))
        metered.recorded = []
        run_arm(eng, metered, None, load)
        cost = on_step_cost(metered.recorded, base.engine.spec.methods)
    step_s = 1 / statistics.median(w for w, _ in off)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}, "
          f"model {args.size}, batch {args.batch} (none/ngram/prediction), {args.new_tokens} new tokens, "
          f"{metered.steps} steps per run")
    for i, clock in enumerate(("wall", "CPU")):
        ratios = [b[i] / a[i] for a, b in zip(off, on)]
        print(f"steps per {clock} second: off {statistics.median(r[i] for r in off):8.1f}, "
              f"on {statistics.median(r[i] for r in on):8.1f} (medians); ratio on/off median "
              f"{statistics.median(ratios):.3f} (rounds: {' '.join(f'{r:.3f}' for r in ratios)})")
    print("target: ratio >= 0.98")
    print(f"on_step alone: {cost * 1e6:.1f} us per step = {cost / step_s:.2%} of a {step_s * 1e3:.2f} ms step "
          f"-> expected ratio {step_s / (step_s + cost):.4f}")


if __name__ == "__main__":
    main()
