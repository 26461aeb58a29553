"""Measure the family: held-out loss per model, greedy completions, and greedy speculative acceptance.

Greedy verification accepts a draft token iff it equals the target's greedy token, so acceptance can be computed
from the target's own greedy continuation by teacher forcing: up to the first mismatch the drafted tokens ARE the
target's tokens. One forward of each speculator over the target's greedy sequence gives, for every position, how
many of its k chained proposals match; a walk over the continuation (advance by accepted + 1 per step) then gives
the mean acceptance length = generated tokens / target steps = 1 + accepted / drafts.

    python -m training.evaluate --prompts 8 --new-tokens 128     # writes runs/eval/results.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specserve.sampling.truncation import apply_top_k_top_p
from training import common
from training.corpus import heldout_functions
from training.eagle1 import Eagle1Head
from training.eagle3 import Eagle3Head, aux_layer_ids
from training.export import draft_ids_from_d2t, load_llama
from training.lm_loop import evaluate as lm_heldout
from training.model import LlamaLM
from training.train_eagle3 import head_spec

# sampled completions beside the greedy one: greedy decoding of a small LM degenerates into loops that
# sampling does not show (Holtzman et al. 2019), so the card measures both
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seeds": 3}


def function_prompts(n: int, lines: int = 3) -> list[str]:
    """The first `lines` lines of the first long-enough function of each held-out file (sorted, deterministic)."""
    out, seen = [], set()
    for rel, node, src_lines in heldout_functions():
        if rel in seen or node.end_lineno - node.lineno < 10:
            continue
        seen.add(rel)
        out.append("".join(src_lines[node.lineno - 1:node.lineno - 1 + lines]))
        if len(out) == n:
            break
    return out


@torch.no_grad()
def greedy(model: LlamaLM, ids: list[int], new_tokens: int) -> list[int]:
    """Plain greedy reference loop (full recompute each step; no cache), stops at <|endoftext|> (id 0)."""
    seq = list(ids)
    for _ in range(new_tokens):
        nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
        seq.append(nxt)
        if nxt == 0:
            break
    return seq


@torch.no_grad()
def sample(model: LlamaLM, ids: list[int], new_tokens: int, temperature: float, top_p: float, seed: int) -> list[int]:
    """The same loop drawing from the temperature-scaled nucleus (top_p, the server's own truncation)."""
    gen = torch.Generator().manual_seed(seed)
    seq = list(ids)
    for _ in range(new_tokens):
        logits = model(torch.tensor([seq]))[0, -1:].float() / temperature                  # [1, vocab]
        kept = logits if top_p >= 1.0 else apply_top_k_top_p(
            logits, torch.tensor([logits.shape[1]]), torch.tensor([top_p]), max_top_k=0, use_top_p=True)
        nxt = int(torch.multinomial(kept.softmax(-1)[0], 1, generator=gen))
        seq.append(nxt)
        if nxt == 0:
            break
    return seq


def walk(match_len, start: int, end: int, k: int) -> float:
    """match_len(p) = how many of the k proposals made after position p match; returns tokens per target step."""
    p, steps = start, 0
    while p < end:
        p += min(match_len(p), k, max(end - p - 1, 0)) + 1
        steps += 1
    return (end - start) / max(steps, 1)


def chain_matches(correct: torch.Tensor) -> torch.Tensor:
    """correct [N, k] bool (proposal j made at position p matches) -> leading-run length [N]."""
    return correct.int().cumprod(dim=1).sum(dim=1)


@torch.no_grad()
def acceptance(target: LlamaLM, seq: list[int], start: int, draft: LlamaLM | None, head: Eagle3Head | None,
               k: int, eagle1: Eagle1Head | None = None) -> dict:
    """Tokens per step for each speculator over the target's greedy sequence seq (generated part from `start`)."""
    x = torch.tensor([seq])
    T = len(seq)
    out = {}
    # position p = index of the last known token; proposals predict seq[p+1 ..]
    if draft is not None:   # draft's one-step predictions under teacher forcing, chained k deep
        pred = draft(x)[0].argmax(-1)                                     # [T] pred[t] predicts seq[t+1]
        ok = torch.zeros(T + k, dtype=torch.bool)
        ok[:T - 1] = pred[:-1] == x[0, 1:]
        corr = torch.stack([ok[p + torch.arange(k)] for p in range(T)])
        m = chain_matches(corr)
        out["draft"] = walk(lambda p: int(m[p]), start - 1, T - 1, k)
    hidden, captured = target.trunk(x, capture=aux_layer_ids(target.spec.num_hidden_layers))
    if target.mtp is not None:   # MTP row i (h_i, token i+1) predicts seq[i+2]; proposal after position p uses row p-1
        mp = target.mtp_logits(x, hidden)[0].argmax(-1)                  # [T-1]
        ok = torch.zeros(T + 1, dtype=torch.bool)
        ok[1:T - 1] = mp[:T - 2] == x[0, 2:]                              # ok[p]: row p-1 correct
        out["mtp_k1"] = walk(lambda p: int(ok[p]), start - 1, T - 1, 1)
        out["mtp_first_pos_accept"] = float(ok[start:T - 1].float().mean()) if T - 1 > start else 0.0
    if head is not None:   # EAGLE row i (aux_i, token i+1), step j predicts seq[i+2+j]; proposals after p use row p-1
        layers = aux_layer_ids(target.spec.num_hidden_layers)
        aux = torch.cat([captured[i] for i in layers], -1)
        m = _head_matches(head, aux, x, k)
        out["eagle3"] = walk(lambda p: int(m[p]), start - 1, T - 1, k)
    if eagle1 is not None:   # the same rows, fed by the target's final-normed state instead of the taps
        m1 = _head_matches(eagle1, hidden, x, k)
        out["eagle"] = walk(lambda p: int(m1[p]), start - 1, T - 1, k)
    return out


def _head_matches(head, feats: torch.Tensor, x: torch.Tensor, k: int) -> torch.Tensor:
    """feats [1, T, F] the head's step-0 input per row, x [1, T] -> leading-run length of matches [T + 1]."""
    T = x.shape[1]
    nxt = torch.cat([x[:, 1:], torch.zeros(1, k, dtype=x.dtype)], 1)
    corr = torch.zeros(T + 1, k, dtype=torch.bool)
    for j, lg in enumerate(head.ttt_logits(feats, nxt, k)):
        pj = head.to_target_ids(lg[0].argmax(-1))                         # [T] row i predicts seq[i+2+j]
        n = max(0, T - 2 - j)
        corr[1:1 + n, j] = pj[:n] == x[0, 2 + j:2 + j + n]
    return chain_matches(corr)


def load_head(path: Path, target: LlamaLM) -> Eagle3Head:
    from safetensors.torch import load_file
    sd = load_file(str(path / "model.safetensors"))
    d2t = sd.pop("d2t", None)
    sd.pop("t2d", None)
    draft_ids = None if d2t is None else draft_ids_from_d2t(d2t)
    head = Eagle3Head(head_spec(target.spec), target.spec.hidden_size, target.model.embed_tokens.weight, draft_ids)
    sd = {k: v.float() for k, v in sd.items()}
    sd["embed_tokens.weight"] = target.model.embed_tokens.weight
    if draft_ids is not None:
        sd["draft_ids"] = draft_ids
    head.load_state_dict(sd)
    return head.eval()


def load_eagle1(path: Path, target: LlamaLM) -> Eagle1Head:
    """An export_eagle1 checkpoint back into the training module (embedding and lm_head: the target's)."""
    from safetensors.torch import load_file
    cfg = json.loads((path / "config.json").read_text())
    head = Eagle1Head(head_spec(target.spec), target, fc_bias=cfg.get("bias", True))
    sd = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    sd["embed_tokens.weight"] = target.model.embed_tokens.weight
    sd["lm_head.weight"] = target.lm_head.weight
    head.load_state_dict(sd)
    return head.eval()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=common.REPO / "models")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heldout-windows", type=int, default=None, help="default: the whole held-out split")
    ap.add_argument("--out", type=Path, default=common.RUNS_DIR / "eval" / "results.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = common.load_tokenizer()
    target = load_llama(args.models / "target").eval()
    draft = load_llama(args.models / "draft").eval() if (args.models / "draft").exists() else None
    head = load_head(args.models / "eagle3", target) if (args.models / "eagle3").exists() else None
    eagle1 = load_eagle1(args.models / "eagle", target) if (args.models / "eagle").exists() else None
    _, held = common.token_streams()
    win = common.eval_windows(held, 512, args.heldout_windows)
    res = {"heldout_loss": {"target": lm_heldout(target, win)}}
    if draft is not None:
        res["heldout_loss"]["draft"] = lm_heldout(draft, win)
    print(json.dumps(res), flush=True)
    samples, acc = [], []
    for prompt in function_prompts(args.prompts):
        t0 = time.time()
        ids = tok.encode(prompt).ids
        seq = greedy(target, ids, args.new_tokens)
        a = acceptance(target, seq, len(ids), draft, head, args.k, eagle1)
        acc.append(a)
        sampled = [tok.decode(sample(target, ids, args.new_tokens, SAMPLED["temperature"], SAMPLED["top_p"],
                                     seed)[len(ids):]) for seed in range(SAMPLED["seeds"])]
        samples.append({"prompt": prompt, "completion": tok.decode(seq[len(ids):]), **a, "sampled": sampled})
        print(json.dumps(samples[-1]), f"{time.time() - t0:.0f}s", flush=True)
    res["acceptance_mean"] = {key: sum(a[key] for a in acc) / len(acc) for key in acc[0]} if acc else {}
    res["samples"] = samples
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res["acceptance_mean"]), flush=True)


if __name__ == "__main__":
    main()
