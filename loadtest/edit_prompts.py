"""Code-editing and free-completion prompt builders from held-out standard-library source.

Editing prompts ask for a function back with one identifier renamed; the expected output repeats the
input almost verbatim, which is the workload n-gram lookup and Predicted Outputs are for.
"""
from __future__ import annotations

import ast
import re
import sysconfig
from pathlib import Path

HELD_OUT_FILES = ("textwrap.py", "fnmatch.py", "shlex.py", "colorsys.py", "bisect.py", "sched.py")


def _functions(min_lines: int = 8, max_lines: int = 30) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in HELD_OUT_FILES:
        path = root / name
        if not path.is_file():
            continue
        src = path.read_text(encoding="utf-8")
        lines = src.splitlines()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if min_lines <= n <= max_lines and node.col_offset == 0:
                    out.append("\n".join(lines[node.lineno - 1:node.end_lineno]) + "\n")
    return out


def edit_cases(limit: int = 8) -> list[tuple[str, str]]:
    """(prompt, expected output) pairs: rename the first argument everywhere in the function."""
    cases = []
    for fn in _functions():
        m = re.match(r"def \w+\((\w+)", fn)
        if not m or m.group(1) in ("self", "cls") or len(m.group(1)) < 2:
            continue
        old = m.group(1)
        new = old + "_value"
        edited = re.sub(rf"\b{old}\b", new, fn)
        prompt = f"# Original:\n{fn}\n# The same function with `{old}` renamed to `{new}`:\n"
        cases.append((prompt, edited))
        if len(cases) == limit:
            break
    return cases


def completion_prompts(limit: int = 8) -> list[str]:
    """The first lines of held-out functions (signature + docstring start)."""
    out = []
    for fn in _functions():
        out.append("\n".join(fn.splitlines()[:3]) + "\n")
        if len(out) == limit:
            break
    return out
