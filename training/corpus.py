"""The training corpus: the Python standard library's own .py source, split by file.

Why the stdlib: it is on every machine (PSF-licensed), it is real Python, and it needs no
network. What is left out and why:
  * test packages (`test/`, `tests/`, `idlelib/idle_test/`, `lib2to3/tests/`, ...): huge, repetitive
    and not what users ask a code model to write;
  * `site-packages/` (third-party code, differs per machine), `lib-dynload/`, `config-*/`;
  * machine-generated files: `_sysconfigdata_*` (differs per machine), `pydoc_data/topics.py`
    (a dump of the docs as one string literal) and the gencodec charmap tables in `encodings/`
    (thousands of lines of `'\\x00'  #  0x00 -> NULL`).

The split is by file (never by line), decided by a seeded shuffle of the sorted relative paths,
so it is identical on every machine with the same Python version (the manifest records the
version and a hash of the file list). Documents are joined with the end-of-text token.

Worked example: files [a.py, b.py, c.py], heldout_fraction 1/3, seed 0 -> the shuffle puts one
whole file into held-out; `join_documents(["x", "y"])` == "x<|endoftext|>y<|endoftext|>".
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EOT = "<|endoftext|>"
SPLIT_SEED = 1234
HELDOUT_FRACTION = 0.05

EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
    "lib-dynload", "__phello__",
})
EXCLUDED_FILES = frozenset({"pydoc_data/topics.py"})
GENERATED_MARKERS = ("Python Character Mapping Codec generated from",)


@dataclass(frozen=True)
class Corpus:
    root: Path
    train_files: tuple[str, ...]     # relative posix paths, sorted
    heldout_files: tuple[str, ...]   # relative posix paths, sorted

    def read(self, rel: str) -> str:
        return read_source(self.root / rel)

    def train_texts(self) -> list[str]:
        return [self.read(p) for p in self.train_files]

    def heldout_texts(self) -> list[str]:
        return [self.read(p) for p in self.heldout_files]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_source(path: Path) -> str:
    # Newlines are kept as they are in the file (no universal-newline translation).
    return path.read_bytes().decode("utf-8")


def _is_excluded_dir(name: str) -> bool:
    return name in EXCLUDED_DIRS or name.startswith("config-")


def _is_generated(text: str) -> bool:
    head = text[:2000]
    return any(m in head for m in GENERATED_MARKERS)


def list_source_files(root: Path) -> list[str]:
    """All eligible .py files under root as sorted relative posix paths."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _is_excluded_dir(d))
        for fn in filenames:
            if not fn.endswith(".py") or fn.startswith("_sysconfigdata"):
                continue
            full = Path(dirpath) / fn
            rel = full.relative_to(root).as_posix()
            if rel in EXCLUDED_FILES:
                continue
            try:
                text = read_source(full)
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip() or _is_generated(text):
                continue
            out.append(rel)
    return sorted(out)


def split_files(files: list[str], heldout_fraction: float = HELDOUT_FRACTION,
                seed: int = SPLIT_SEED) -> tuple[list[str], list[str]]:
    """Deterministic split by file: sort, seeded shuffle, the first n go to held-out."""
    ordered = sorted(files)
    rng = random.Random(seed)
    rng.shuffle(ordered)
    n_held = max(1, round(len(ordered) * heldout_fraction)) if len(ordered) > 1 else 0
    return sorted(ordered[n_held:]), sorted(ordered[:n_held])


def load_corpus(root: Path | None = None, heldout_fraction: float = HELDOUT_FRACTION,
                seed: int = SPLIT_SEED) -> Corpus:
    root = Path(root) if root is not None else stdlib_root()
    train, held = split_files(list_source_files(root), heldout_fraction, seed)
    return Corpus(root, tuple(train), tuple(held))


def heldout_functions(corpus: Corpus | None = None):
    """Yield (file, function node, the file's lines with line ends) for every function in the held-out
    files, in file order then ast.walk order. Shared by evaluation prompts and loadtest prompt sets."""
    import ast
    corpus = corpus or load_corpus()
    for rel in corpus.heldout_files:
        src = corpus.read(rel)
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield rel, node, lines


def join_documents(texts: list[str]) -> str:
    """Each document followed by the end-of-text token."""
    return "".join(t + EOT for t in texts)


def manifest(corpus: Corpus) -> dict:
    h = hashlib.sha256("\n".join(corpus.train_files + ("--",) + corpus.heldout_files).encode())
    size = lambda fs: sum((corpus.root / f).stat().st_size for f in fs)
    return {
        "python_version": sys.version.split()[0],
        "split_seed": SPLIT_SEED,
        "heldout_fraction": HELDOUT_FRACTION,
        "train_files": len(corpus.train_files),
        "heldout_files": len(corpus.heldout_files),
        "train_bytes": size(corpus.train_files),
        "heldout_bytes": size(corpus.heldout_files),
        "file_list_sha256": h.hexdigest(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list-heldout", action="store_true")
    args = ap.parse_args(argv)
    c = load_corpus()
    if args.list_heldout:
        print("\n".join(c.heldout_files))
        return
    print(json.dumps(manifest(c), indent=2))


if __name__ == "__main__":
    main()
