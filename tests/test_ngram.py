"""N-gram matcher and the n-gram / prediction speculators (no model)."""
import numpy as np
import pytest

from specserve.sampling.params import SamplingParams
from specserve.server.engine.request import Request
from specserve.speculators.base import SpecParams
from specserve.speculators.ngram import NgramSpeculator
from specserve.speculators.ngram_match import TokenBuffer, longest_match
from specserve.speculators.prediction import PredictionSpeculator


def arr(x):
    return np.asarray(x, dtype=np.int64)


def brute_force(source, tail, lo, hi, want):
    """Slow reference: longest n, then latest occurrence with room, else latest."""
    for n in range(min(hi, len(tail)), lo - 1, -1):
        pat = list(tail[-n:])
        starts = [i + n for i in range(len(source) - n + 1) if list(source[i:i + n]) == pat]
        if starts:
            roomy = [s for s in starts if s + want <= len(source)]
            return (roomy or starts)[-1]
    return -1


def test_docstring_example():
    assert longest_match(arr([5, 1, 2, 3, 9, 1, 2, 7]), arr([1, 2]), 1, 3) == 7


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 4, size=rng.integers(1, 60))
    tail = rng.integers(0, 4, size=rng.integers(1, 8))
    lo, hi, want = int(rng.integers(1, 3)), int(rng.integers(1, 6)), int(rng.integers(1, 5))
    if lo > hi:
        lo, hi = hi, lo
    assert longest_match(src, tail, lo, hi, want) == brute_force(src, tail, lo, hi, want)


def test_min_n_rejects_short_matches():
    assert longest_match(arr([1, 2, 3]), arr([9, 3]), 2, 4) == -1
    assert longest_match(arr([1, 2, 3]), arr([9, 3]), 1, 4) == 3


def test_token_buffer_grows():
    b = TokenBuffer([1, 2])
    b.extend(list(range(200)))
    assert b.view().tolist() == [1, 2] + list(range(200))


NGRAM_4 = SpecParams("ngram", 4)


def mkreq(prompt, out=(), spec=NGRAM_4, pred=None):
    r = Request("r", list(prompt), SamplingParams(max_tokens=50), spec, prediction_token_ids=pred)
    r.output_token_ids = list(out)
    return r


def test_ngram_proposes_continuation_and_follows_output_growth():
    spec = NgramSpeculator()
    r = mkreq([10, 11, 12, 13, 14, 15, 10, 11])
    assert spec.propose([r], [3]).token_ids == [[12, 13, 14]]
    r.output_token_ids += [12, 13]
    assert spec.propose([r], [2]).token_ids == [[14, 15]]
    none = mkreq([1, 2, 3, 4])
    assert spec.propose([none], [3]).token_ids == [[]]


def test_ngram_options_are_validated():
    spec = NgramSpeculator()
    spec.validate({"prompt_lookup_min": 2, "prompt_lookup_max": 3})
    for bad in ({"prompt_lookup_min": 0}, {"prompt_lookup_max": 99}, {"x": 1},
                {"prompt_lookup_min": 4, "prompt_lookup_max": 2}):
        with pytest.raises(ValueError):
            spec.validate(bad)


def test_prediction_follows_then_realigns():
    pred = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    spec = PredictionSpeculator()
    r = mkreq([100, 101], spec=SpecParams("prediction", 3), pred=pred)
    assert spec.propose([r], [3]).token_ids == [[1, 2, 3]]
    r.output_token_ids = [1, 2]
    assert spec.propose([r], [3]).token_ids == [[3, 4, 5]]
    r.output_token_ids += [42]                      # diverged: no 2-gram [2, 42] in the prediction
    assert spec.propose([r], [3]).token_ids == [[]]
    r.output_token_ids += [5, 6]                    # suffix [5, 6] re-aligns after 6
    assert spec.propose([r], [3]).token_ids == [[7, 8, 9]]
