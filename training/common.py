"""Shared training plumbing: token streams, batches, lr schedule, optimizer, eval, checkpoints, progress.

Everything is deterministic given the seed: batch k of epoch e is a function of (seed, e, k) only, so a run that
is cut and resumed from its checkpoint sees exactly the batches an uncut run would have seen.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from training.corpus import EOT, load_corpus

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "models" / "tokenizer"
RUNS_DIR = REPO / "runs"


# ---------------------------------------------------------------- data
def load_tokenizer(path: Path = TOKENIZER_DIR):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def encode_documents(tok, texts: list[str]) -> np.ndarray:
    """Each document followed by <|endoftext|> -> one uint16 stream [N]."""
    eot = tok.token_to_id(EOT)
    out: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eot)
    return np.asarray(out, dtype=np.uint16)


def token_streams(tokenizer_dir: Path = TOKENIZER_DIR, cache_dir: Path = RUNS_DIR / "cache"):
    """(train [N], heldout [M]) uint16 token streams, cached by the tokenizer's hash and the file list."""
    corpus = load_corpus()
    key = hashlib.sha256((Path(tokenizer_dir) / "tokenizer.json").read_bytes()
                         + "\n".join(corpus.train_files + ("--",) + corpus.heldout_files).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"tokens_{key}.npz"
    if path.exists():
        z = np.load(path)
        return z["train"], z["heldout"]
    tok = load_tokenizer(tokenizer_dir)
    train = encode_documents(tok, corpus.train_texts())
    held = encode_documents(tok, corpus.heldout_texts())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, train=train, heldout=held)
    os.replace(tmp, path)
    return train, held


class BatchSource:
    """Epoch-wise shuffled, non-overlapping windows of seq_len+1 tokens.

    Epoch e starts the chunking at a seeded offset in [0, seq_len) and visits the chunks in a seeded
    permutation, so every token is seen once per epoch and windows straddle different boundaries each epoch.
    """

    def __init__(self, stream: np.ndarray, batch_size: int, seq_len: int, seed: int):
        self.stream = torch.from_numpy(stream.astype(np.int64))
        self.B, self.T, self.seed = batch_size, seq_len, seed
        self.steps_per_epoch = (len(stream) - seq_len - 1) // ((seq_len + 1) * batch_size)
        if self.steps_per_epoch < 1:
            raise ValueError(f"stream of {len(stream)} tokens is too short for batch {batch_size}x{seq_len}")
        self._epoch, self._order, self._offset = -1, None, 0

    @property
    def tokens_per_step(self) -> int:
        return self.B * self.T

    def _prepare(self, epoch: int) -> None:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        self._offset = int(torch.randint(0, self.T, (1,), generator=g))
        n_chunks = (len(self.stream) - self._offset) // (self.T + 1)
        self._order = torch.randperm(n_chunks, generator=g)
        self._epoch = epoch

    def batch(self, step: int) -> torch.Tensor:
        """Global step -> input ids [B, T+1] (inputs and shifted labels come from the same window)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._prepare(epoch)
        idx = self._order[k * self.B:(k + 1) * self.B]
        starts = self._offset + idx * (self.T + 1)
        return torch.stack([self.stream[s:s + self.T + 1] for s in starts.tolist()])


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int | None) -> torch.Tensor:
    """Evenly spaced non-overlapping held-out windows [n, seq_len+1]; all of them when max_windows is None."""
    s = torch.from_numpy(stream.astype(np.int64))
    n = len(s) // (seq_len + 1)
    windows = s[: n * (seq_len + 1)].view(n, seq_len + 1)
    if max_windows is not None and n > max_windows:
        windows = windows[torch.linspace(0, n - 1, max_windows).long()]
    return windows


# ---------------------------------------------------------------- optimisation
@dataclass
class Schedule:
    """Linear warmup to peak, then either cosine down to min_ratio*peak at total_steps (decay_frac = 1), or
    warmup-stable-decay (decay_frac < 1): flat at peak, then linear down to min_ratio*peak over the last
    decay_frac of the steps. Flat at the floor after total_steps.

    Worked example: peak 1e-3, warmup 10, total 110, decay_frac 0.2 -> 1e-4 at step 0, 1e-3 for steps 9..87,
    linear to 0 between steps 88 and 110.
    """
    peak_lr: float
    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.0
    decay_frac: float = 1.0

    def lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.decay_frac >= 1.0:
            span = max(1, self.total_steps - self.warmup_steps)
            t = min(1.0, (step - self.warmup_steps) / span)
            return self.peak_lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
        decay_start = self.total_steps - int(self.decay_frac * self.total_steps)
        if step < decay_start:
            return self.peak_lr
        t = min(1.0, (step - decay_start) / max(1, self.total_steps - decay_start))
        return self.peak_lr * (1 - (1 - self.min_ratio) * t)


def make_optimizer(module: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW(0.9, 0.95); weight decay on matrices only (not norms, not embeddings)."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed_tokens" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


# ---------------------------------------------------------------- run bookkeeping
@dataclass
class RunState:
    step: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    total_steps: int = 0
    history: list = field(default_factory=list)   # eval records


def save_checkpoint(path: Path, module, opt, state: RunState, extra: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": module.state_dict(), "opt": opt.state_dict(), "state": asdict(state), "extra": extra}, tmp)
    os.replace(tmp, path)   # atomic: a cut run never leaves a half-written checkpoint


def load_checkpoint(path: Path, module, opt) -> tuple[RunState, dict] | None:
    if not path.exists():
        return None
    dev = next(module.parameters()).device
    ck = torch.load(path, map_location=dev, weights_only=False)
    module.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    return RunState(**ck["state"]), ck["extra"]


class Logger:
    """Prints progress lines and appends JSON records to <run>/log.jsonl."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "log.jsonl"

    def __call__(self, record: dict, line: str) -> None:
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def fmt_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


def steps_for_budget(tokens: int | None, minutes: float | None, tokens_per_step: int,
                     measured_tps: float | None) -> int:
    """Total optimizer steps from a token budget, or from minutes x a measured tokens/s."""
    if tokens is None:
        if minutes is None or measured_tps is None:
            raise ValueError("give --tokens, or --minutes (then throughput is measured first)")
        tokens = int(minutes * 60 * measured_tps)
    return max(1, tokens // tokens_per_step)


@functools.cache
def cpu_bf16_fast() -> bool:
    """Whether this CPU multiplies training-sized bf16 matrices clearly (> 1.5x) faster than fp32.

    AMX / AVX512-BF16 CPUs do (~4x at 4096x512x2048); AVX2-only CPUs run bf16 far slower. Training
    matmuls are compute-bound, so this is not the server's decode probe (a 1-row product, where bf16
    can lose even on AMX). SPECSERVE_TRAIN_PRECISION=fp32|bf16 overrides it.
    """
    forced = os.environ.get("SPECSERVE_TRAIN_PRECISION", "auto")
    if forced in ("fp32", "bf16"):
        return forced == "bf16"
    a, w = torch.randn(1024, 512), torch.randn(512, 1024)

    def seconds(x: torch.Tensor, y: torch.Tensor) -> float:
        x @ y
        t = time.perf_counter()
        for _ in range(5):
            x @ y
        return time.perf_counter() - t

    ratio = seconds(a, w) / seconds(a.bfloat16(), w.bfloat16())
    print(
        f"[training] CPU bf16 matmul speed vs fp32: {ratio:.2f}x -> {'bf16 autocast' if ratio > 1.5 else 'fp32'}",
        flush=True,
    )
    return ratio > 1.5


def precision(device_type: str) -> str:
    """What autocast() trains in on this device: "bf16-autocast" or "fp32" (recorded in run summaries)."""
    return "bf16-autocast" if device_type == "cuda" or (device_type == "cpu" and cpu_bf16_fast()) else "fp32"


def autocast(device_type: str):
    """bf16 autocast (fp32 master weights) on CUDA and on CPUs with fast bf16 units; plain fp32 elsewhere
    (AVX2-only CPUs have no bf16 units: their bf16 matmuls run ~25x slower)."""
    if precision(device_type) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def setup_torch(threads: int, seed: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
