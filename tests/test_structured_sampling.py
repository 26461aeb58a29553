"""Sampling under a grammar stays exact with speculation: the whole output's distribution (every output
of regex [abc]{3,4} is complete within 5 tokens) equals the target's grammar-masked distribution,
computed exactly from the target's raw logits and the grammar's masks (chi-square), with deterministic
drafts (ngram: often grammar-forbidden, so rejected at their position) and sampled ones (a draft model,
proposing under the mask; once a different random model, once one equal to the target, whose drafts are
accepted, so that the rows after the first are read). A planted bug (target rows masked without the
draft prefix) fails it.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_rejection_stats import chi_square_p_value
from test_spec_draft_model import make_engine, write_llama

from specserve.grammar.state import GrammarState
from specserve.sampling.params import SamplingParams, StructuredSpec
from specserve.speculators.base import SpecParams

SPEC = StructuredSpec("regex", "[abc]{3,4}")
PROMPT = "abc cab bca abc ab"
NUM_SAMPLES = 2000


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-sampling")
    out = {"target_dir": root / "other" / "target"}
    for name, draft in (("other", dict(seed=12, num_hidden_layers=1)), ("same", dict(seed=11))):
        target = write_llama(root / name / "target", seed=11)
        out[name] = make_engine(target, kv_gb=0.02, draft_model=str(write_llama(root / name / "draft", **draft)),
                                max_num_seqs=128)
    return out


@pytest.fixture(scope="module")
def engine(engines):
    return engines["other"]


def raw_logits(model, contexts: list[list[int]]) -> list[torch.Tensor]:
    """[vocab] raw target log-probabilities after each context, from transformers' forward of the same
    checkpoint (tests/test_models_hf_equivalence.py holds ours equal to it)."""
    with torch.no_grad():
        return [model(torch.tensor([ctx])).logits[0, -1].double().log_softmax(-1) for ctx in contexts]


def exact_outputs(engine, model, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """Every complete output under SPEC with its probability under the grammar-masked target (T = 1)."""
    compiler = engine.engine.grammars
    eos = set(engine.engine.tokenizer.eos_token_ids)
    leaves: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while frontier:
        logits = raw_logits(model, [prompt + list(prefix) for prefix, _ in frontier])
        nxt = []
        for (prefix, p), row in zip(frontier, logits):
            state: GrammarState = compiler.start(SPEC)
            state.commit(list(prefix))
            allowed = state.row_masks([])[0][0]
            probs = row.masked_fill(~allowed, float("-inf")).softmax(-1)
            for tok in torch.nonzero(probs > 0).flatten().tolist():
                seq, q = prefix + (tok,), p * float(probs[tok])
                after = compiler.start(SPEC)
                after.commit(list(seq))
                if tok in eos or after.is_finished:
                    leaves[seq] = leaves.get(seq, 0.0) + q
                else:
                    nxt.append((seq, q))
        frontier = nxt
    return leaves


def sampled_cells(engine, prompt, method, k, leaves, num=NUM_SAMPLES) -> torch.Tensor:
    index = {seq: i for i, seq in enumerate(leaves)}
    params = SamplingParams(temperature=1.0, max_tokens=5, structured=SPEC)
    outs = engine.generate([prompt] * num, [dataclasses.replace(params, seed=s) for s in range(num)],
                           SpecParams(method, k, adaptive=False))
    drafted = sum(o.spec_stats.num_draft_tokens for o in outs)
    assert drafted > num // 2, f"{method} drafted {drafted} tokens: the test would not test it"
    # an output outside the exact support gets the extra cell, whose probability is 0
    return torch.tensor([index.get(tuple(o.token_ids), len(index)) for o in outs])


@pytest.fixture(scope="module")
def exact(engines, engine):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(engines["target_dir"], torch_dtype=torch.float32).eval()
    prompt = engine.engine.tokenizer.encode(PROMPT)
    leaves = exact_outputs(engine, model, prompt)
    assert abs(sum(leaves.values()) - 1.0) < 1e-6 and len(leaves) > 10
    assert sum(p for seq, p in leaves.items() if len(seq) >= 3) > 0.3   # rows after the first matter
    return prompt, leaves


def probs_of(leaves) -> torch.Tensor:
    return torch.tensor([*leaves.values(), 0.0], dtype=torch.float64)


@pytest.mark.parametrize("method,drafter", [("ngram", "other"), ("draft", "other"), ("draft", "same")])
def test_sampling_under_a_grammar_keeps_the_masked_target_distribution(engines, exact, method, drafter):
    prompt, leaves = exact
    cells = sampled_cells(engines[drafter], prompt, method, 3, leaves)
    p_value = chi_square_p_value(cells, probs_of(leaves))
    assert p_value > 1e-3, f"{method}: p = {p_value:.2e}"


def test_the_statistic_catches_masks_computed_without_the_draft_prefix(engines, exact, monkeypatch):
    """Planted bug: every verification row gets the mask of the committed state, as if the drafts before
    it were not there. With a drafter equal to the target (drafts accepted, so rows after the first are
    read often) outputs then leave the grammar or lose the mass the true mask gives EOS."""
    prompt, leaves = exact

    def row_masks_without_prefix(self, drafts):
        first, _ = original(self, [])
        return first.expand(len(drafts) + 1, -1).clone(), len(drafts)
    original = GrammarState.row_masks
    monkeypatch.setattr(GrammarState, "row_masks", row_masks_without_prefix)
    cells = sampled_cells(engines["same"], prompt, "draft", 3, leaves, num=1500)
    assert chi_square_p_value(cells, probs_of(leaves)) < 1e-6
