"""Train the EAGLE-3 head on the frozen target (distillation to the target's logits over corpus text, with
training-time test), export in the public EAGLE-3 head layout to models/eagle3. `--head eagle1` trains an
EAGLE-1 head (training/eagle1.py) with the same loop and exports the SafeAILab EAGLE-1 layout.

    python -m training.train_eagle3 --target models/target --minutes 20 --threads 2   # resumable
    python -m training.train_eagle1 --target models/target --tokens 3e6 --threads 1    # models/eagle
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from training import common, eagle1
from training.eagle3 import (
    Eagle3Head,
    aux_layer_ids,
    select_draft_vocab,
    target_features,
    ttt_loss,
)
from training.export import export_eagle1, export_eagle3, load_llama
from training.model import LlamaLM, LlamaSpec, count_params


def head_spec(target: LlamaSpec) -> LlamaSpec:
    """One layer as wide as the target, same RoPE; vocab_size is the TARGET's (the embedding it reads and
    t2d's length). The lm_head's own size, the draft vocabulary, is chosen by --draft-vocab."""
    return LlamaSpec(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                     intermediate_size=target.intermediate_size, num_hidden_layers=1,
                     num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                     max_position_embeddings=target.max_position_embeddings, rope_theta=target.rope_theta,
                     rms_norm_eps=target.rms_norm_eps)


@torch.no_grad()
def evaluate(head: Eagle3Head, target: LlamaLM, windows: torch.Tensor, layers, steps: int, batch: int = 8,
             features=target_features) -> dict:
    """Per-step soft-CE and top-1 agreement with the target on held-out windows, plus the acceptance length a
    greedy chain of `steps` drafts would get if the per-step agreements were independent (an estimate)."""
    head.eval()
    ces = [0.0] * steps
    accs = [0.0] * steps
    n = 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(next(head.parameters()).device)
        with common.autocast(w.device.type):
            aux, tl = features(target, w, layers)
            _, c, a = ttt_loss(head, aux, w, tl, steps)
        for j in range(steps):
            ces[j] += c[j] * len(w)
            accs[j] += a[j] * len(w)
        n += len(w)
    head.train()
    accs = [a / n for a in accs]
    est, run = 1.0, 1.0
    for a in accs:
        run *= a
        est += run
    return {"heldout_ce": [round(c / n, 4) for c in ces], "heldout_top1": [round(a, 4) for a in accs],
            "est_accept_len": round(est, 3)}


def train(args) -> dict:
    common.setup_torch(args.threads, args.seed)
    train_stream, held_stream = common.token_streams()
    target = load_llama(args.target).to(args.device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    if args.head == "eagle1":
        head = eagle1.Eagle1Head(head_spec(target.spec), target, args.fc_bias)
        layers, features = (), eagle1.target_features
    else:
        head = _eagle3_head(args, target, train_stream)
        layers, features = aux_layer_ids(target.spec.num_hidden_layers), target_features
    head.to(args.device)
    opt = common.make_optimizer(head, args.lr, args.weight_decay)
    src = common.BatchSource(train_stream, args.batch_size, args.seq_len, args.seed)
    ev = common.eval_windows(held_stream, args.seq_len, args.eval_windows)
    run_dir = common.RUNS_DIR / args.name
    ckpt = run_dir / "ckpt.pt"
    if args.fresh and ckpt.exists():
        ckpt.unlink()
    log = common.Logger(run_dir)
    loaded = common.load_checkpoint(ckpt, head, opt)
    st = loaded[0] if loaded else common.RunState()
    frozen = sum(p.numel() for p in head.parameters() if not p.requires_grad)
    print(f"[{args.name}] head params {count_params(head) - frozen} (+{frozen} frozen from the target),"
          f" aux layers {layers}, ttt steps {args.ttt_steps}" + (f"; resumed at step {st.step}" if loaded else ""),
          flush=True)
    if st.total_steps == 0 and args.tokens:
        st.total_steps = common.steps_for_budget(int(args.tokens), None, src.tokens_per_step, None)
    t_start = last_eval = last_ckpt = time.time()
    probe = None
    while st.total_steps == 0 or st.step < st.total_steps:
        t0 = time.time()
        sched = common.Schedule(args.lr, args.warmup_steps, max(st.total_steps, args.warmup_steps + 1), 0.0,
                                args.decay_frac)
        common.set_lr(opt, sched.lr(st.step))
        w = src.batch(st.step).to(args.device)
        with common.autocast(args.device):
            aux, tl = features(target, w, layers)
            loss, ces, accs = ttt_loss(head, aux, w, tl, args.ttt_steps, row_stride=args.row_stride)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        st.step += 1
        st.tokens += src.tokens_per_step
        st.train_seconds += time.time() - t0
        if st.total_steps == 0:
            if st.step == 2:
                probe = (time.time(), st.tokens)
            elif st.step == 5:
                tps = (st.tokens - probe[1]) / (time.time() - probe[0])
                st.total_steps = common.steps_for_budget(None, args.minutes, src.tokens_per_step, tps)
                print(f"[{args.name}] probe {tps:.0f} tok/s -> {st.total_steps} steps", flush=True)
        tps = st.tokens / st.train_seconds
        if st.step % args.log_every == 0:
            eta = (st.total_steps - st.step) * src.tokens_per_step / tps if st.total_steps else 0
            log({"step": st.step, "tokens": st.tokens, "ce": ces, "top1": accs, "tok_per_s": tps},
                f"[{args.name}] step {st.step}/{st.total_steps} tok {st.tokens / 1e6:.2f}M ce "
                + " ".join(f"{c:.3f}" for c in ces) + " top1 " + " ".join(f"{a:.2f}" for a in accs)
                + f" lr {sched.lr(st.step):.2e} {tps:.0f} tok/s ETA {common.fmt_eta(eta)}")
        done = st.total_steps and st.step >= st.total_steps
        if time.time() - last_eval > args.eval_every_s or done:
            r = evaluate(head, target, ev, layers, args.eval_steps, features=features)
            st.history.append(dict(r, step=st.step))
            log(dict(r, kind="eval", step=st.step), f"[{args.name}] EVAL {r}")
            last_eval = time.time()
        cut = args.stop_after_minutes is not None and time.time() - t_start > args.stop_after_minutes * 60
        if time.time() - last_ckpt > args.ckpt_every_s or done or cut:
            common.save_checkpoint(ckpt, head, opt, st, {"args": {k: str(v) for k, v in vars(args).items()}})
            last_ckpt = time.time()
        if cut and not done:
            print(f"[{args.name}] stopped at step {st.step}; rerun to resume", flush=True)
            return {"finished": False}
    summary = {"finished": True, "tokens": st.tokens, "steps": st.step, "ttt_steps": args.ttt_steps,
               **st.history[-1]}
    log(dict(summary, kind="final"), f"[{args.name}] FINAL {summary}")
    if not args.no_export:
        info = {"tokens": st.tokens, "ttt_steps": args.ttt_steps, "lr": args.lr, "seed": args.seed,
                "draft_vocab": head.draft_vocab_size,
                "heldout_top1_per_step": summary["heldout_top1"], "target": _repo_relative(args.target)}
        if args.head == "eagle1":
            export_eagle1(head.cpu(), args.out, training_info=info)
        else:
            export_eagle3(head.cpu(), target.spec, args.out, layers, training_info=info)
        print(f"[{args.name}] exported {args.out}", flush=True)
    return summary


def _eagle3_head(args, target: LlamaLM, train_stream) -> Eagle3Head:
    draft_ids = None
    if args.draft_vocab and args.draft_vocab < target.spec.vocab_size:
        draft_ids = select_draft_vocab(train_stream, target.spec.vocab_size, args.draft_vocab)
        share = float(torch.isin(torch.as_tensor(train_stream).long(), draft_ids).float().mean())
        print(f"[{args.name}] draft vocabulary: the {args.draft_vocab} most frequent of {target.spec.vocab_size} "
              f"ids ({share:.1%} of training tokens)", flush=True)
    head = Eagle3Head(head_spec(target.spec), target.spec.hidden_size, target.model.embed_tokens.weight, draft_ids)
    head.init_from_target(target)
    return head


def _repo_relative(path: Path) -> str:
    """models/target rather than this machine's absolute path (the config ships in the repo)."""
    try:
        return str(Path(path).resolve().relative_to(common.REPO))
    except ValueError:
        return str(path)


def main(argv=None, head: str = "eagle3"):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", choices=["eagle3", "eagle1"], default=head)
    ap.add_argument("--fc-bias", action=argparse.BooleanOptionalAction, default=True,
                    help="eagle1: fc carries a bias (the Vicuna/LLaMA2 heads do; the LLaMA3 heads do not)")
    ap.add_argument("--target", type=Path, default=common.REPO / "models" / "target")
    ap.add_argument("--out", type=Path, default=None, help="default models/eagle3 (eagle1: models/eagle)")
    ap.add_argument("--name", default=None, help="run name under runs/ (default: the head kind)")
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--decay-frac", type=float, default=0.2, help="warmup-stable-decay tail (1 = cosine)")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="lm_head over the N most frequent corpus ids (d2t/t2d in the export); 0 = full vocabulary")
    ap.add_argument("--eval-steps", type=int, default=4, help="chain length scored at eval (k=4)")
    ap.add_argument("--row-stride", type=int, default=2, help="score every n-th row (lm_head cost)")
    ap.add_argument("--tokens", type=float, default=None)
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--stop-after-minutes", type=float, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every-s", type=float, default=300.0)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--ckpt-every-s", type=float, default=300.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda; bf16 autocast where common.precision says so")
    args = ap.parse_args(argv)
    args.out = args.out or common.REPO / "models" / ("eagle" if args.head == "eagle1" else "eagle3")
    args.name = args.name or args.head
    return train(args)


if __name__ == "__main__":
    main()
