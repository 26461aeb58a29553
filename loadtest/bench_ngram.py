"""N-gram proposer cost: 64 requests with contexts up to 4k tokens, one propose() call per step.

Prints microseconds per request per step for each context length. Run: python -m loadtest.bench_ngram
"""
from __future__ import annotations

import time

import numpy as np

from specserve.sampling.params import SamplingParams
from specserve.server.engine.request import Request
from specserve.speculators.base import SpecParams
from specserve.speculators.ngram import NgramSpeculator


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{'context':>8} {'requests':>8} {'us/request/step':>16} {'drafts found':>12}")
    for ctx in (256, 1024, 4096):
        reqs = []
        for i in range(64):
            # code-like: a vocabulary of 2k with repeated spans, so matches exist
            base = rng.integers(0, 2000, size=ctx // 4)
            toks = np.concatenate([base, base[:ctx // 8], rng.integers(0, 2000, size=ctx - ctx // 4 - ctx // 8)])
            r = Request(f"r{i}", toks[:-16].tolist(), SamplingParams(max_tokens=64), SpecParams("ngram", 4))
            r.output_token_ids = toks[-16:].tolist()
            reqs.append(r)
        spec = NgramSpeculator()
        spec.propose(reqs, [4] * 64)                   # builds the per-request buffers once
        steps = 50
        t = time.perf_counter()
        found = 0
        for _ in range(steps):
            for r in reqs:
                r.output_token_ids.append(int(rng.integers(0, 2000)))
            out = spec.propose(reqs, [4] * 64)
            found += sum(1 for d in out.token_ids if d)
        dt = (time.perf_counter() - t) / steps / 64
        print(f"{ctx:8d} {64:8d} {dt * 1e6:16.1f} {found / steps / 64:12.2f}")


if __name__ == "__main__":
    main()
