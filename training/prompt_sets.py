"""Builds the benchmark prompt sets in loadtest/prompts/*.jsonl from the corpus's HELD-OUT files.

  code_completion   first lines of a held-out function (signature + docstring start)
  code_editing      a held-out function and an instruction to rename its first argument; the
                    expected output (repeats the input) is stored as `prediction`
  docstring_to_code a docstring-only stub to implement
  prose             English paragraphs from pydoc_data.topics (never in the training corpus)

Rebuild (deterministic): python -m training.prompt_sets
"""
from __future__ import annotations

import ast
import json
import random
import re

from loadtest.prompt_sets import PROMPT_DIR
from training.corpus import heldout_functions

PER_SET = 32


def _heldout_functions(min_lines: int = 6, max_lines: int = 40) -> list[str]:
    return ["".join(lines[node.lineno - 1:node.end_lineno]).rstrip("\n") + "\n"
            for _, node, lines in heldout_functions()
            if isinstance(node, ast.FunctionDef) and node.col_offset == 0
            and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines]


def _completion(fns: list[str]) -> list[dict]:
    return [{"prompt": "\n".join(f.splitlines()[:3]) + "\n"} for f in fns]


def _editing(fns: list[str]) -> list[dict]:
    rows = []
    for fn in fns:
        m = re.match(r"def \w+\((\w+)", fn)
        if not m or m.group(1) in ("self", "cls") or len(m.group(1)) < 2:
            continue
        old, new = m.group(1), m.group(1) + "_value"
        edited = re.sub(rf"\b{old}\b", new, fn)
        rows.append({"prompt": f"# Original:\n{fn}\n# The same function with `{old}` renamed to `{new}`:\n",
                     "prediction": edited})
    return rows


def _docstring(fns: list[str]) -> list[dict]:
    rows = []
    for fn in fns:
        node = ast.parse(fn).body[0]
        doc = ast.get_docstring(node)
        if doc and len(doc) > 40:
            header = fn.splitlines()[0]
            rows.append({"prompt": f'{header}\n    """{doc}\n    """\n'})
    return rows


def _prose() -> list[dict]:
    from pydoc_data.topics import topics
    rows = []
    for key in sorted(topics):
        paras = [p.strip() for p in topics[key].split("\n\n") if len(p.strip()) > 300 and p[:1].isalpha()]
        if paras:
            rows.append({"prompt": paras[0][:600]})
    return rows


def build() -> None:
    rng = random.Random(0)
    fns = _heldout_functions()
    rng.shuffle(fns)
    PROMPT_DIR.mkdir(exist_ok=True)
    for name, rows in (("code_completion", _completion(fns)), ("code_editing", _editing(fns)),
                       ("docstring_to_code", _docstring(fns)), ("prose", _prose())):
        rows = rows[:PER_SET]
        with open(PROMPT_DIR / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"set": name, **row}) + "\n" for row in rows)
        print(f"{name}: {len(rows)} prompts")


if __name__ == "__main__":
    build()
