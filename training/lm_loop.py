"""The causal-LM training loop shared by the target (with MTP) and the draft model.

Resumable: state lives in runs/<name>/ckpt.pt (model, optimizer, step, token count, schedule length); rerunning
the same command continues where it stopped. `--minutes` is turned into a token budget once, from a short
throughput probe at the start, and frozen in the checkpoint, so the lr schedule never changes on resume.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from training import common
from training.export import export_llama
from training.model import LlamaLM, LlamaSpec, count_params, flops_per_token


@dataclass
class LMTrainConfig:
    name: str
    spec: LlamaSpec
    out_dir: Path | None = None        # export destination (HF layout); None = do not export
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.0
    decay_frac: float = 1.0            # 1 = cosine over the whole run; < 1 = warmup-stable-decay (linear tail)
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    mtp_row_stride: int = 2            # MTP head/loss on every 2nd row: the extra lm_head is the costly part
    tokens: int | None = None
    minutes: float | None = None
    stop_after_minutes: float | None = None   # hard wall-clock stop for this invocation (checkpoint and exit)
    stop_after_steps: int | None = None       # stop this invocation after n steps (checkpoint and exit)
    threads: int = 1
    seed: int = 0
    eval_every_s: float = 600.0
    eval_windows: int = 32
    eval_seq_len: int = 512
    final_eval_windows: int | None = None     # None = the whole held-out split
    ckpt_every_s: float = 300.0
    log_every: int = 10
    fresh: bool = False
    device: str = "cpu"                # bf16 autocast on CUDA and on CPUs with fast bf16 (common.precision)
    compile: bool = False              # torch.compile the training loss (+14 % tokens/s for the target on 2 cores)
    init_from: Path | None = None      # start a new stage from these weights (run ckpt.pt or exported dir)


@torch.no_grad()
def evaluate(model: LlamaLM, windows: torch.Tensor, batch: int = 8) -> dict:
    """Mean next-token CE (and MTP t+2 CE) over windows [n, T+1]."""
    model.eval()
    main_sum = mtp_sum = 0.0
    n_main = n_mtp = 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(next(model.parameters()).device)
        with common.autocast(w.device.type):
            main, mtp = model.losses(w)
        k = w.shape[0] * (w.shape[1] - 1)
        main_sum += float(main) * k
        n_main += k
        if mtp is not None:
            km = w.shape[0] * (w.shape[1] - 2)
            mtp_sum += float(mtp) * km
            n_mtp += km
    model.train()
    out = {"heldout_loss": main_sum / n_main}
    if n_mtp:
        out["heldout_mtp_loss"] = mtp_sum / n_mtp
    return out


def _step(model, opt, batch, cfg: LMTrainConfig, lr: float, losses_fn) -> tuple[float, float | None]:
    common.set_lr(opt, lr)
    with common.autocast(cfg.device):
        main, mtp = losses_fn(batch.to(cfg.device), cfg.mtp_row_stride)
    loss = main if mtp is None or cfg.mtp_weight == 0 else main + cfg.mtp_weight * mtp
    loss.backward()
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return main.item(), (mtp.item() if mtp is not None else None)


def train_lm(cfg: LMTrainConfig, train_stream=None, heldout_stream=None) -> tuple[LlamaLM, dict]:
    common.setup_torch(cfg.threads, cfg.seed)
    if train_stream is None:
        train_stream, heldout_stream = common.token_streams()
    run_dir = common.RUNS_DIR / cfg.name
    ckpt = run_dir / "ckpt.pt"
    if cfg.fresh and ckpt.exists():
        ckpt.unlink()
    log = common.Logger(run_dir)
    model = LlamaLM(cfg.spec).to(cfg.device)
    opt = common.make_optimizer(model, cfg.lr, cfg.weight_decay)
    src = common.BatchSource(train_stream, cfg.batch_size, cfg.seq_len, cfg.seed)
    ev = common.eval_windows(heldout_stream, cfg.eval_seq_len, cfg.eval_windows)
    loaded = common.load_checkpoint(ckpt, model, opt)
    st = loaded[0] if loaded else common.RunState()
    prior = _prior_training(cfg.init_from, len(train_stream)) if cfg.init_from else {"tokens": 0, "epochs": 0.0}
    if cfg.init_from and not loaded:     # a new stage: earlier weights, fresh optimizer and lr schedule
        _init_weights(model, cfg.init_from)
        print(f"[{cfg.name}] initialised from {cfg.init_from} ({prior['tokens'] / 1e6:.2f}M tokens before)", flush=True)
    n_params = count_params(model)
    print(
        f"[{cfg.name}] params {n_params / 1e6:.2f}M "
        f"(main {count_params(model.model) / 1e6 + model.lm_head.weight.numel() / 1e6:.2f}M)"
        f" fwd {flops_per_token(cfg.spec) / 1e6:.1f} MFLOP/token; train stream {len(train_stream)} tokens"
        f" ({src.steps_per_epoch} steps/epoch at {src.tokens_per_step} tokens/step)"
        + (f"; resumed at step {st.step}" if loaded else ""),
        flush=True,
    )
    if st.total_steps == 0 and cfg.tokens is not None:
        st.total_steps = common.steps_for_budget(cfg.tokens, None, src.tokens_per_step, None)
    sched = lambda: common.Schedule(
        cfg.lr,
        cfg.warmup_steps,
        max(st.total_steps, cfg.warmup_steps + 1),  # noqa: E731
        cfg.min_lr_ratio,
        cfg.decay_frac,
    )
    # Only the training step is compiled (one static shape); held-out evals run the eager model.
    losses_fn = torch.compile(model.losses) if cfg.compile else model.losses
    t_start, start_step = time.time(), st.step
    last_eval = last_ckpt = time.time()
    probe_t0, ema = None, None
    while st.total_steps == 0 or st.step < st.total_steps:
        t0 = time.time()
        main, mtp = _step(model, opt, src.batch(st.step), cfg, sched().lr(st.step), losses_fn)
        dt = time.time() - t0
        st.step += 1
        st.tokens += src.tokens_per_step
        st.train_seconds += dt
        ema = main if ema is None else 0.95 * ema + 0.05 * main
        if st.total_steps == 0:  # --minutes: probe throughput over steps 3..8, then freeze the schedule
            if st.step == 3:
                probe_t0 = (time.time(), st.tokens)
            elif st.step == 8:
                tps = (st.tokens - probe_t0[1]) / (time.time() - probe_t0[0])
                st.total_steps = common.steps_for_budget(None, cfg.minutes, src.tokens_per_step, tps)
                print(
                    f"[{cfg.name}] probe {tps:.0f} tok/s -> {st.total_steps} steps"
                    f" ({st.total_steps * src.tokens_per_step / 1e6:.2f}M tokens)",
                    flush=True,
                )
        tps = st.tokens / max(st.train_seconds, 1e-9)
        remaining = (st.total_steps - st.step) * src.tokens_per_step / tps if st.total_steps else 0
        if st.step % cfg.log_every == 0:
            rec = {
                "step": st.step,
                "tokens": st.tokens,
                "epoch": st.step / src.steps_per_epoch,
                "loss": main,
                "loss_ema": ema,
                "mtp_loss": mtp,
                "lr": sched().lr(st.step),
                "tok_per_s": tps,
                "train_seconds": st.train_seconds,
            }
            log(
                rec,
                f"[{cfg.name}] step {st.step}/{st.total_steps} ep {rec['epoch']:.2f} tok {st.tokens / 1e6:.2f}M"
                f" loss {ema:.3f}"
                + (f" mtp {mtp:.3f}" if mtp is not None else "")
                + f" lr {rec['lr']:.2e} {tps:.0f} tok/s ETA {common.fmt_eta(remaining)}",
            )
        done = st.total_steps and st.step >= st.total_steps
        if time.time() - last_eval > cfg.eval_every_s or done:
            r = dict(evaluate(model, ev), step=st.step, tokens=st.tokens, train_seconds=st.train_seconds)
            st.history.append(r)
            log(
                dict(r, kind="eval"),
                f"[{cfg.name}] EVAL step {st.step} tok {st.tokens / 1e6:.2f}M held-out "
                f"{r['heldout_loss']:.4f}" + (f" mtp {r['heldout_mtp_loss']:.4f}" if "heldout_mtp_loss" in r else ""),
            )
            last_eval = time.time()
        cut = (cfg.stop_after_minutes is not None and time.time() - t_start > cfg.stop_after_minutes * 60) or (
            cfg.stop_after_steps is not None and st.step - start_step >= cfg.stop_after_steps
        )
        if time.time() - last_ckpt > cfg.ckpt_every_s or done or cut:
            common.save_checkpoint(ckpt, model, opt, st, {"config": _cfg_dict(cfg)})
            last_ckpt = time.time()
        if cut and not done:
            print(f"[{cfg.name}] stopped at step {st.step} (--stop-after-*); rerun to resume", flush=True)
            return model, {"finished": False, "state": st}
    final = evaluate(model, common.eval_windows(heldout_stream, cfg.eval_seq_len, cfg.final_eval_windows))
    summary = {
        "finished": True,
        "params": n_params,
        "tokens": st.tokens,
        "steps": st.step,
        "epochs": st.step / src.steps_per_epoch,
        "train_seconds": round(st.train_seconds),
        "tok_per_s": round(st.tokens / max(st.train_seconds, 1e-9)),
        "precision": common.precision(cfg.device),
        **final,
    }
    log(dict(summary, kind="final"), f"[{cfg.name}] FINAL {summary}")
    if cfg.out_dir is not None:
        info = {k: summary[k] for k in ("tokens", "epochs", "heldout_loss") if k in summary}
        info.update(
            {"lr": cfg.lr, "batch": [cfg.batch_size, cfg.seq_len], "seed": cfg.seed, "precision": summary["precision"]}
        )
        if cfg.init_from:  # cumulative over stages, with each stage listed
            stages = prior.get("stages") or [{"tokens": prior["tokens"], "epochs": prior["epochs"]}]
            info["stages"] = stages + [
                {
                    "tokens": summary["tokens"],
                    "epochs": summary["epochs"],
                    "lr": cfg.lr,
                    "precision": summary["precision"],
                }
            ]
            info["tokens"] = prior["tokens"] + summary["tokens"]
            info["epochs"] = prior["epochs"] + summary["epochs"]
        export_llama(
            model.cpu(),
            cfg.out_dir,
            mtp_loss_weight=cfg.mtp_weight if cfg.spec.num_nextn_predict_layers else None,
            training_info=info,
        )
        print(f"[{cfg.name}] exported {cfg.out_dir}", flush=True)
    return model, summary


def _init_weights(model: LlamaLM, source: Path) -> None:
    """Weights from a run checkpoint (runs/<name>/ckpt.pt: fp32) or an exported model directory."""
    from training.export import load_llama

    source = Path(source)
    if source.is_file():
        model.load_state_dict(torch.load(source, map_location="cpu", weights_only=False)["model"])
    else:
        model.load_state_dict(load_llama(source).state_dict())


def _prior_training(source: Path, stream_len: int) -> dict:
    """Tokens and epochs the source weights were trained on (for cumulative figures in the export)."""
    import json

    source = Path(source)
    if source.is_file():
        tokens = torch.load(source, map_location="cpu", weights_only=False)["state"]["tokens"]
        return {"tokens": tokens, "epochs": tokens / max(stream_len, 1)}
    info = json.loads((source / "config.json").read_text()).get("specserve_training", {})
    return {"tokens": info.get("tokens", 0), "epochs": info.get("epochs", 0.0), "stages": info.get("stages")}


def _cfg_dict(cfg: LMTrainConfig) -> dict:
    d = asdict(cfg)
    d["out_dir"] = str(cfg.out_dir) if cfg.out_dir else None
    d["init_from"] = str(cfg.init_from) if cfg.init_from else None
    return d


def add_common_args(ap: argparse.ArgumentParser, defaults: LMTrainConfig) -> None:
    ap.add_argument("--name", default=defaults.name)
    ap.add_argument("--out", type=Path, default=defaults.out_dir)
    ap.add_argument("--no-export", action="store_true")
    for flag, typ in (
        ("batch_size", int),
        ("seq_len", int),
        ("lr", float),
        ("min_lr_ratio", float),
        ("decay_frac", float),
        ("warmup_steps", int),
        ("weight_decay", float),
        ("grad_clip", float),
        ("mtp_weight", float),
        ("threads", int),
        ("seed", int),
        ("eval_every_s", float),
        ("eval_windows", int),
        ("ckpt_every_s", float),
        ("log_every", int),
        ("mtp_row_stride", int),
    ):
        ap.add_argument("--" + flag.replace("_", "-"), type=typ, default=getattr(defaults, flag))
    ap.add_argument("--tokens", type=float, default=None, help="token budget (e.g. 5e6)")
    ap.add_argument("--minutes", type=float, default=None, help="time budget; converted to tokens by a probe")
    ap.add_argument("--stop-after-minutes", type=float, default=None, help="hard stop for this invocation")
    ap.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    ap.add_argument("--final-eval-windows", type=int, default=None)
    ap.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda; bf16 autocast on cuda and on CPUs with fast bf16 "
        "(probed; SPECSERVE_TRAIN_PRECISION=fp32|bf16 forces it), else fp32",
    )
    ap.add_argument("--compile", action="store_true", help="torch.compile the training step (first step ~2 min)")
    ap.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start a new training stage (own --name, fresh optimizer and schedule) from a run's "
        "ckpt.pt or an exported model directory; the export reports cumulative tokens",
    )


def config_from_args(args, spec: LlamaSpec) -> LMTrainConfig:
    return LMTrainConfig(
        name=args.name,
        spec=spec,
        out_dir=None if args.no_export else args.out,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        decay_frac=args.decay_frac,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        mtp_weight=args.mtp_weight,
        tokens=int(args.tokens) if args.tokens else None,
        minutes=args.minutes,
        stop_after_minutes=args.stop_after_minutes,
        threads=args.threads,
        seed=args.seed,
        eval_every_s=args.eval_every_s,
        eval_windows=args.eval_windows,
        ckpt_every_s=args.ckpt_every_s,
        final_eval_windows=args.final_eval_windows,
        fresh=args.fresh,
        log_every=args.log_every,
        mtp_row_stride=args.mtp_row_stride,
        device=args.device,
        compile=args.compile,
        init_from=args.init_from,
    )
