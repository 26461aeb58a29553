"""Plain-decoding benchmark: our engine vs Hugging Face transformers generate(), side by side.

Same random ~30M Llama weights, same dtype, same prompt, greedy, 128 new tokens. Prints ratios:
  batch 1:  ours tok/s / HF tok/s (fp32 and bf16), eager and with --compile (best of rounds, interleaved)
  batch 16: our aggregate tok/s with 16 concurrent requests / ours with 1
  roofline: our decode step time / (weight bytes / measured matvec memory bandwidth)

Run: make bench-decode   (or python -m loadtest.bench_decode --dtypes float32 bfloat16)
"""
from __future__ import annotations

import argparse
import logging
import tempfile
import time

import torch

from specserve import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig

CONFIG_30M = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=True)


def make_checkpoint(path: str, vocab: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **CONFIG_30M))
    model.save_pretrained(path, safe_serialization=True)
    from transformers import AutoTokenizer

    from specserve.server.models.embedded import require as embedded_family
    AutoTokenizer.from_pretrained(str(embedded_family().tokenizer)).save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def hf_tokens_per_s(path: str, dtype: torch.dtype, prompt: list[int], new: int) -> float:
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
    ids = torch.tensor([prompt])
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
        t = time.perf_counter()
        model.generate(ids, **kw)
        return new / (time.perf_counter() - t)


def ours_tokens_per_s(eng: LLM, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(aggregate tokens/s, mean seconds per engine step during decode)."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    eng.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), "none")
    t = time.perf_counter()
    outs = eng.generate(prompts, params, "none")
    dt = time.perf_counter() - t
    total = sum(len(o.token_ids) for o in outs)
    steps = max(o.num_steps for o in outs)
    return total / dt, dt / steps


def best_of_rounds(measure: dict, rounds: int) -> dict:
    """name -> zero-argument tokens/s function; runs them interleaved `rounds` times -> name -> best."""
    best = dict.fromkeys(measure, 0.0)
    for _ in range(rounds):
        for name, fn in measure.items():
            best[name] = max(best[name], fn())
    return best


def matvec_bandwidth(dtype: torch.dtype, device: str = "cpu") -> float:
    """Bytes/s streaming a 128 MiB-ish weight matrix through a matrix-vector product on `device`."""
    n = 8192 if dtype == torch.float32 else 11585
    w = torch.randn(n, n).to(dtype).to(device)
    x = torch.randn(1, n).to(dtype).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(2):
        x @ w.T
    sync()
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        x @ w.T
    sync()
    return w.numel() * w.element_size() * reps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="shortcut for a single --dtypes value")
    ap.add_argument("--quick", action="store_true", help="fewer tokens (GPU smoke check)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved batch-1 rounds per engine; best counts")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dtypes = [args.dtype] if args.dtype else args.dtypes
    new = 32 if args.quick else args.new_tokens
    from specserve.server.engine.tokenizer import Tokenizer
    from specserve.server.models.embedded import require as embedded_family
    vocab = Tokenizer(str(embedded_family().tokenizer)).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.concurrency)]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}")
    with tempfile.TemporaryDirectory() as path:
        nparams = make_checkpoint(path, vocab)
        print(f"model: random Llama {nparams / 1e6:.1f}M params, prompt {args.prompt_len}, new {new}")
        print(f"{'dtype':9} {'HF b1':>8} {'ours b1':>8} {'ratio':>6} {'compiled':>8} {'ratio':>6} | "
              f"{'ours b16':>9} {'b16/b1':>7} | {'step ms':>7} {'roofline ms':>11} {'ratio':>6}")
        for name in dtypes:
            dtype = getattr(torch, name)
            def engine(compile_: bool, name: str = name) -> LLM:
                return LLM(config=EngineConfig(model=path, dtype=name, device=args.device,
                                               kv_cache_memory_gb=0.5, compile=compile_))

            engines = {"eager": engine(False)}
            try:
                engines["compiled"] = engine(True)
            except RuntimeError as exc:   # --compile unavailable here (e.g. no C++ compiler): eager still counts
                print(f"{name}: --compile failed, compiled column left empty: {exc}")
            measure = {mode: (lambda e=eng: ours_tokens_per_s(e, prompts[:1], new)[0])
                       for mode, eng in engines.items()}
            if args.device == "cpu":
                measure["hf"] = lambda dtype=dtype: hf_tokens_per_s(path, dtype, prompts[0], new)
            best = best_of_rounds(measure, args.rounds)
            hf = best.get("hf", float("nan"))
            b1, b1c = best["eager"], best.get("compiled", float("nan"))
            bn, _ = ours_tokens_per_s(engines["eager"], prompts, new)
            weight_bytes = nparams * torch.tensor([], dtype=dtype).element_size()
            roof = weight_bytes / matvec_bandwidth(dtype, args.device)
            step = 1 / b1
            print(f"{name:9} {hf:8.1f} {b1:8.1f} {b1 / hf:6.2f} {b1c:8.1f} {b1c / hf:6.2f} | {bn:9.1f} "
                  f"{bn / b1:7.2f} | {step * 1e3:7.2f} {roof * 1e3:11.2f} {step / roof:6.2f}")

if __name__ == "__main__":
    main()
