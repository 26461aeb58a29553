"""speculators/tree_calibration.py: greedy tree nodes scored at the temperature that makes the drafter's
first-choice probability match its measured acceptance, fitted from what the server saw; text unchanged."""
from __future__ import annotations

import pytest
import torch
from test_spec_draft_model import GREEDY, assert_no_leaks, encode, make_engine, write_target_and_draft

from specserve.sampling.params import SamplingParams
from specserve.server.engine import spec_dispatch
from specserve.speculators.base import DraftTree, SpecParams
from specserve.speculators.tree_calibration import SAMPLE_ROWS, ScoreCalibration, first_choice, fit_temperature

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_it_scores_by_log_q_until_it_has_a_target_and_rows_then_fits_the_first_choice():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(SAMPLE_ROWS, 50, generator=g)
    cal = ScoreCalibration()
    assert torch.equal(cal.log_probs(logits[:4]), logits[:4].log_softmax(dim=-1))       # EAGLE-2's score
    cal.set_target(0.9)
    assert cal.temperature == 1.0                         # 4 rows: too few to fit on
    cal.log_probs(logits[4:])                             # enough now: fitted at once to the pending target
    rows = logits.topk(50, dim=-1).values
    assert first_choice(rows, 1.0) < 0.5 and cal.temperature < 1.0     # under-confident rows: sharpened
    assert first_choice(rows, cal.temperature) == pytest.approx(0.9, abs=1e-3)
    scores = cal.log_probs(logits[:1])
    assert torch.allclose(scores, (logits[:1] / cal.temperature).log_softmax(dim=-1))
    assert fit_temperature(rows, 0.01) > 1.0              # an over-confident drafter is flattened
    assert first_choice(torch.tensor([[2.0, 1.0, 0.0, 0.0]]), fit_temperature(torch.tensor([[2.0, 1.0, 0.0, 0.0]]),
                                                                             0.8)) == pytest.approx(0.8, abs=1e-3)


def test_the_engine_hands_each_drafter_its_greedy_acceptance_and_trees_keep_the_text(tmp_path, monkeypatch):
    monkeypatch.setattr(spec_dispatch, "CALIBRATE_EVERY", 4)
    dirs = write_target_and_draft(tmp_path)
    engine = make_engine(dirs["target"], kv_gb=0.01, draft_model=str(dirs["draft"]))
    prompts = encode(engine)
    params = SamplingParams(**GREEDY, max_tokens=40)
    plain = [o.token_ids for o in engine.generate(prompts, params)]
    tree = SpecParams("draft", 8, draft_tree=DraftTree(top_k=3, depth=4))
    first = [o.token_ids for o in engine.generate(prompts, params, tree)]
    cal = engine.engine.spec.speculators["draft"].trees.calibration
    learner = engine.engine.spec.learner
    assert learner.history.attempted("draft") >= spec_dispatch.CALIBRATION_EVIDENCE
    assert cal.target is not None and cal.temperature != 1.0
    assert cal.target == pytest.approx(min(max(learner.alpha("draft", 0, 0, "greedy"), 0.01), 0.99), abs=0.2)
    again = [o.token_ids for o in engine.generate(prompts, params, tree)]       # scored at the fitted T
    assert first == plain and again == plain
    assert_no_leaks(engine)
