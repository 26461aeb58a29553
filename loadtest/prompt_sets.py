"""Fixed prompt sets shipped in loadtest/prompts/*.jsonl, built from the corpus's HELD-OUT files.

  code_completion   first lines of a held-out function (signature + docstring start)
  code_editing      a held-out function and an instruction to rename its first argument; the
                    expected output (repeats the input) is stored as `prediction`
  docstring_to_code a docstring-only stub to implement
  prose             English paragraphs from pydoc_data.topics (never in the training corpus)
  json_schema       16 JSON-schema tasks (a prompt and a bounded `schema`), written by hand for the
                    structured-output benchmark (loadtest/bench_structured.py)

Workloads built from them at run time (they need the model's own answers):

  repeated          the same prompts sent again later (agent loops, retries, evaluation harnesses):
                    `repeated(prompts)` is the order the requests arrive in; the second send is measured
  agentic           multi-turn editing: each turn's prompt is the previous turn's prompt and output plus
                    a short instruction (`next_turn`)
  mixed             repeated and fresh requests interleaved (`mixed`)

They are built from the training corpus's held-out split by training/prompt_sets.py
(`python -m training.prompt_sets`); this module only reads them.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

PROMPT_DIR = Path(__file__).resolve().parent / "prompts"
SETS = ("code_completion", "code_editing", "docstring_to_code", "prose", "json_schema")


def load_prompt_set(name: str, n: int | None = None, seed: int = 0) -> list[dict]:
    if name in WORKLOADS:
        return _workload(name, n or 16, seed)
    path = PROMPT_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise SystemExit(f"unknown prompt set {name!r}; have {[p.stem for p in PROMPT_DIR.glob('*.jsonl')]}")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if n is None:
        return rows
    rng = random.Random(seed)
    return [rows[i % len(rows)] for i in rng.sample(range(len(rows)), min(n, len(rows)))] + \
        [rows[i % len(rows)] for i in range(max(0, n - len(rows)))]


AGENTIC_INSTRUCTIONS = (
    "\n\n# Now rewrite the function above with type hints:\n",
    "\n\n# Now the same function again, with a docstring that lists its arguments:\n",
    "\n\n# Now the same function, with one comment per step:\n",
)


def next_turn(prompt: str, answer: str, turn: int) -> str:
    """The prompt of agentic turn `turn + 1`: the conversation so far and the next instruction."""
    return prompt + answer + AGENTIC_INSTRUCTIONS[turn % len(AGENTIC_INSTRUCTIONS)]


def repeated(prompts: list, times: int = 2) -> list:
    """Every prompt `times` times, each repeat after all the first sends (a later retry, not a burst)."""
    return [p for _ in range(times) for p in prompts]


def mixed(repeats: list, fresh: list) -> list:
    """Repeated and fresh requests alternating: [repeat 0, fresh 0, repeat 1, fresh 1, ...]."""
    out = []
    for i in range(max(len(repeats), len(fresh))):
        out += repeats[i:i + 1] + fresh[i:i + 1]
    return out


# Served workloads over HTTP (loadtest.serve, the sweep): code-completion rows arranged as the workload
# says, with one OpenAI `user` so that a server's per-user suffix cache may share their answers.
WORKLOADS = ("repeated", "mixed")
WORKLOAD_USER = "loadtest"


def _workload(name: str, n: int, seed: int) -> list[dict]:
    """repeated: n/2 prompts, then the same again; mixed: n/3 prompts, then their repeats alternating
    with n/3 fresh ones."""
    m = max(1, n // 2 if name == "repeated" else n // 3)
    rows = [dict(r, user=WORKLOAD_USER) for r in load_prompt_set("code_completion", 2 * m, seed)]
    if name == "repeated":
        return repeated(rows[:m])
    return rows[:m] + mixed(rows[:m], rows[m:])
