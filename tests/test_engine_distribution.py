"""Unseeded sampled speculation through the whole engine keeps the target's distribution, with a draft
model and with an EAGLE-3 head, at T = 1 with top-p and min-p (rejection sampling, draft_probs wired from
the drafter to the verifier by the engine).

Every greedy-equality test is blind to which draft_probs row reaches the sampler; this one is not.
Thousands of identical requests generate 4 tokens each (k = 3: the second step verifies 2 drafts); the
histogram of the 4-token continuations is compared (chi-square) with the exact law, computed from the
target's full-vocabulary logits by transformers and truncated here by hand (min-p, then top-p).

A few tokens carry the mass so that the law has few cells and drafts get accepted: the target's lm_head
has rows only for six tokens S (the others score 0) and the requests add logit_bias +BIAS to S, so the
processed law lives on S, a different law at every position. The draft model is the target with noise
on every weight and S's rows scaled up (it concentrates on S without the bias); the EAGLE-3 head is
random with S as its reduced draft vocabulary. A planted wiring bug (each request's draft_probs rows
rotated by one: the rows of other positions) must fail the test.
"""
from __future__ import annotations

import pytest
import torch
from test_rejection_stats import chi_square_p_value
from test_spec_draft_model import BASE, Rand, block_tensors, llama_tensors, make_engine, vocab_size, write_checkpoint

from specserve.sampling.params import SamplingParams
from specserve.speculators.base import SpecParams

PROMPT = [91, 281, 540, 20, 15, 673]
NUM_TOKENS = 4
TOP_P, MIN_P = 0.9, 0.1
NUM_REQUESTS = 1500
S = [317, 835, 11, 68, 15, 309]
BIAS = 12.0
TARGET_SCALE = 1.0
EAGLE_SCALE = 1.0


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def target_tensors(cfg: dict) -> dict:
    t = llama_tensors(cfg, Rand(21))
    head = torch.zeros_like(t["lm_head.weight"])
    head[S] = t["lm_head.weight"][S] * TARGET_SCALE
    t["lm_head.weight"] = head
    return t


def processed(logits: torch.Tensor) -> torch.Tensor:  # [n, vocab] -> [n, vocab] float64
    """+BIAS on S, T = 1, min-p, then top-p over what min-p kept (sampling/truncation.py's order)."""
    logits = logits.double()
    logits[:, S] += BIAS
    probs = logits.softmax(-1)
    probs = torch.where(probs >= MIN_P * probs.amax(-1, keepdim=True), probs, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    values, order = probs.sort(-1, descending=True)
    before = values.cumsum(-1) - values
    values = torch.where(before < TOP_P, values, 0.0)
    out = torch.zeros_like(probs).scatter_(1, order, values)
    return out / out.sum(-1, keepdim=True)


def exact_law(target_dir) -> dict[tuple[int, ...], float]:
    """P(t1..t4 | PROMPT) for every continuation of positive probability (transformers' forward)."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_TOKENS):
        prefixes = list(law)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]   # [n, vocab]
        rows = processed(logits)
        law = {p + (t,): law[p] * float(rows[i, t]) for i, p in enumerate(prefixes)
               for t in rows[i].nonzero().flatten().tolist()}
    return law


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distribution")
    cfg = {**BASE, "vocab_size": vocab_size(), "num_hidden_layers": 8}
    tensors = target_tensors(cfg)
    target = write_checkpoint(root / "target", cfg, tensors)
    noise = Rand(5)
    noisy = {k: v + 0.1 * v.std() * noise.mat(*v.shape, scale=1.0) for k, v in tensors.items()}
    noisy["lm_head.weight"][S] *= 3.0
    draft = write_checkpoint(root / "draft", cfg, noisy)
    law = exact_law(target)
    assert {t for seq in law for t in seq} <= set(S)
    eagle = write_eagle(root / "eagle3", S)
    engine = make_engine(target, kv_gb=0.02, draft_model=str(draft), eagle3=str(eagle),
                         speculation_policy="fixed", max_num_seqs=256, enable_prefix_caching=False)
    return engine, law


def write_eagle(out, support: list[int]):
    """A random EAGLE-3 head (original layout) whose reduced draft vocabulary is `support`."""
    rand = Rand(31)
    used = torch.tensor(support)
    hidden = BASE["hidden_size"]
    t = {"midlayer." + k: v for k, v in block_tensors("", BASE, rand, in_mult=2).items()}
    t["midlayer.hidden_norm.weight"] = rand.norm(hidden)
    t["fc.weight"] = rand.mat(hidden, 3 * hidden)
    t["norm.weight"] = rand.norm(hidden)
    t["lm_head.weight"] = rand.mat(len(used), hidden, scale=0.5) * EAGLE_SCALE
    t["d2t"] = used - torch.arange(len(used))
    t["t2d"] = torch.zeros(vocab_size(), dtype=torch.bool).index_fill_(0, used, True)
    cfg = {**BASE, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
           "vocab_size": vocab_size(), "draft_vocab_size": len(used), "target_hidden_size": hidden}
    return write_checkpoint(out, cfg, t, tokenizer=False)


def continuations(engine, method: str, rotate: bool = False) -> tuple[list[tuple[int, ...]], float]:
    """NUM_REQUESTS unseeded requests' 4 tokens, and the fraction of drafts accepted."""
    spec = engine.engine.spec.speculators[method]
    if rotate:
        original = spec.propose

        def propose(requests, ks):
            proposal = original(requests, ks)
            proposal.draft_probs = [None if p is None else p.roll(1, dims=0) for p in proposal.draft_probs]
            return proposal
        spec.propose = propose
    try:
        params = SamplingParams(temperature=1.0, top_p=TOP_P, min_p=MIN_P, max_tokens=NUM_TOKENS, ignore_eos=True,
                                logit_bias={t: BIAS for t in S})
        outs = engine.generate([PROMPT] * NUM_REQUESTS, params, SpecParams(method, 3))
    finally:
        if rotate:
            del spec.propose
    drafted = sum(o.spec_stats.num_draft_tokens for o in outs)
    accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
    return [tuple(o.token_ids) for o in outs], accepted / max(drafted, 1)


def p_value(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    cells = {seq: i for i, seq in enumerate(law)}
    outside = len(cells)
    index = torch.tensor([cells.get(s, outside) for s in samples])
    probs = torch.tensor([*law.values(), 0.0], dtype=torch.float64)
    return chi_square_p_value(index, probs / probs.sum())


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_sampled_speculation_keeps_the_targets_distribution(setup, method):
    engine, law = setup
    assert max(law.values()) < 0.3 and sum(v > 0.01 for v in law.values()) >= 15     # a law worth testing
    samples, acceptance = continuations(engine, method)
    assert acceptance > 0.1, acceptance                                             # drafts do get accepted
    p = p_value(samples, law)
    print(f"{method}: acceptance {acceptance:.2f}, p = {p:.3g}")
    assert p > 1e-3, p


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_draft_probs_of_the_wrong_row_fail_it(setup, method):
    engine, law = setup
    samples, _ = continuations(engine, method, rotate=True)
    p = p_value(samples, law)
    print(f"{method} with rotated draft_probs rows: p = {p:.3g}")
    assert p < 1e-6, p
