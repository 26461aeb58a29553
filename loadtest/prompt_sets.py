"""Fixed prompt sets shipped in loadtest/prompts/*.jsonl, built from the corpus's HELD-OUT files.

  code_completion   first lines of a held-out function (signature + docstring start)
  code_editing      a held-out function and an instruction to rename its first argument; the
                    expected output (repeats the input) is stored as `prediction`
  docstring_to_code a docstring-only stub to implement
  prose             English paragraphs from pydoc_data.topics (never in the training corpus)
  json_schema       16 JSON-schema tasks (a prompt and a bounded `schema`), written by hand for the
                    structured-output benchmark (loadtest/bench_structured.py)

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
    path = PROMPT_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise SystemExit(f"unknown prompt set {name!r}; have {[p.stem for p in PROMPT_DIR.glob('*.jsonl')]}")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if n is None:
        return rows
    rng = random.Random(seed)
    return [rows[i % len(rows)] for i in rng.sample(range(len(rows)), min(n, len(rows)))] + \
        [rows[i % len(rows)] for i in range(max(0, n - len(rows)))]
