"""The repository speaks about the software, never about how it was built.

Every text file in the checkout (`git ls-files`, tracked and untracked-but-not-ignored; a walk of the tree when
git is unavailable) is scanned line by line for wording about the work process: references to tickets by
number, to work sittings (counted, numbered or "this" one), to borrowed machines and to deferred work;
PROCESS_WORDING below is the exact rule, and test_the_pattern_catches_process_wording lists phrases it must
catch. Binary files, `*.safetensors`, `tokenizer.json` vocabularies and this file (whose samples contain the
words on purpose) are skipped.

In Python files only comments and string literals are scanned (via `tokenize`), so identifiers such as
`session`, `ClientSession` or `session.post(...)` are never read as prose. The word "session" also passes in
code-shaped contexts: `scope="session"`, `session-scoped`, `as session`, `(session, ...)`, and the technical
"test session" / "aiohttp session" (ALLOWED).

PROCESS_WORDING (case-insensitive, verbose):

    \\bissues?\\s*\\#?\\d+                                     a ticket word with its number
  | \\bthe\\s+issue(?:'s|\\s+(?:asks|asked|sets|says|warned|wants))\\b
  | \\blent\\b
  | \\bleft\\s+for\\s+(?:a\\s+|the\\s+)?(?:later|next|session)
  | \\bnot\\s+yet\\s+run\\s+on\\b
  | (?<![\\w.'"`/-])sessions?\\b(?![\\w(=/-]|\\.\\w)              session(s) as a prose word
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve()

PROCESS_WORDING = re.compile(r"""
      \bissues?\s*\#?\d+
    | \bthe\s+issue(?:'s|\s+(?:asks|asked|sets|says|warned|wants))\b
    | \blent\b
    | \bleft\s+for\s+(?:a\s+|the\s+)?(?:later|next|session)
    | \bnot\s+yet\s+run\s+on\b
    | (?<![\w.'"`/-])sessions?\b(?![\w(=/-]|\.\w)
""", re.IGNORECASE | re.VERBOSE)

# Known technical uses of "session" that the prose rule would otherwise read as process wording; removed from a
# line before PROCESS_WORDING looks at it.
ALLOWED = re.compile(r"""
      \bas\s+session\b                                   # async with aiohttp.ClientSession() as session:
    | \(\s*sessions?\s*[,):=]                            # f(session, url) / def f(session: ...)
    | \bsessions?\s*=(?!=)                               # session = aiohttp.ClientSession()
    | \b(?:test|pytest|aiohttp|httpx|http|client|tls|ssh)\s+sessions?\b   # once per test session
""", re.IGNORECASE | re.VERBOSE)

SKIP_SUFFIXES = {".safetensors", ".png", ".jpg", ".jpeg", ".gif", ".pt", ".bin", ".pyc", ".gz", ".zip", ".ico"}
SKIP_NAMES = {"tokenizer.json"}
WALK_SKIP_DIRS = {".git", ".venv", "__pycache__", "runs", "build", "dist", "node_modules", ".pytest_cache",
                  ".ruff_cache"}


def offending(line: str) -> bool:
    """True when the line (after the allowed technical uses are blanked) contains process wording."""
    return PROCESS_WORDING.search(ALLOWED.sub(" ", line)) is not None


def repo_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, check=True, timeout=60).stdout
        names = [n for n in out.decode("utf-8", "surrogateescape").split("\0") if n]
        return sorted({REPO / n for n in names})
    except (OSError, subprocess.SubprocessError):
        files = []
        for root, dirs, names in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in WALK_SKIP_DIRS and not d.endswith(".egg-info")]
            files += [Path(root) / n for n in names]
        return sorted(files)


def text_of(path: Path) -> str | None:
    """The file as text, or None for what is not scanned (binary, weights, vocabularies, this file)."""
    if (path.resolve() == THIS_FILE or path.suffix.lower() in SKIP_SUFFIXES or path.name in SKIP_NAMES
            or not path.is_file()):
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def prose_lines(path: Path, text: str) -> Iterator[tuple[int, str]]:
    """(line number, text) to scan: comments and string literals of Python sources, every line elsewhere."""
    if path.suffix == ".py":
        kinds = {tokenize.COMMENT, tokenize.STRING} | {getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
        try:
            pieces = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                      if tok.type in kinds]
        except (tokenize.TokenError, SyntaxError):
            pieces = None        # a file that does not tokenize is read as plain text
        if pieces is not None:
            for first, string in pieces:
                for i, line in enumerate(string.splitlines()):
                    yield first + i, line
            return
    yield from enumerate(text.splitlines(), start=1)


def findings() -> list[str]:
    found = []
    for path in repo_files():
        text = text_of(path)
        if text is None:
            continue
        for lineno, line in prose_lines(path, text):
            if offending(line):
                found.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()[:160]}")
    return found


def test_no_process_wording_in_the_repository():
    found = findings()
    assert not found, ("wording about how the project was built (describe the software instead):\n"
                       + "\n".join(found))


# The samples spell the words they must catch as {S} (the sitting word) and {I} / {Is} (the ticket word), filled
# in below: the sample text then never reads as process wording to a scan of the source itself.
PROCESS_SAMPLES = [
    "### AMD EPYC, 2026-12-02 (ninth {S})",
    "That is ~240 minutes, i.e. **two {S}s**, with the same command each time:",
    "python -m training.all --{S}-minutes 160     # {S} 1: target",
    "Also measured this {S}:",
    "# cut the run into three invocations (a {S} being stopped) and resume",
    "On this VM the (seventh {S}) numbers",
    "it stopped for the {S}.",
    'gained nothing (bandwidth-bound, README "fifth {S}"), so they keep',
    "this {S}'s runs",
    "Dedicated {S_cap}s ahead",
    "the three comparisons {I} 7 sets goals for",
    "Status against {I} 3's bars",
    "as asked in {I} #3",
    "{Is} 3 and 4 together",
    "{I_cap} 4 end to end: 8 requests",
    "# Names the {I} asks the dashboard to show",
    "The {I}'s warning: 29M model",
    "help='cuda when a GPU is {L} (bf16 autocast)'",
    "flipping the default is left for a later run",
    "left for the next one",
    "written for the H200, not yet run on one",
]
WORDS = {"S": "sess" + "ion", "S_cap": "Sess" + "ion", "I": "iss" + "ue", "Is": "iss" + "ues",
         "I_cap": "Iss" + "ue", "L": "le" + "nt"}


def fill(sample: str) -> str:
    """The sample with its {KEY} placeholders spelled out (str.replace: samples of code keep their own braces)."""
    for key, word in WORDS.items():
        sample = sample.replace("{" + key + "}", word)
    return sample


@pytest.mark.parametrize("line", [sample.format(**WORDS) for sample in PROCESS_SAMPLES])
def test_the_pattern_catches_process_wording(line):
    assert offending(line), line


@pytest.mark.parametrize("line", [fill(sample) for sample in [
    '@pytest.fixture(scope="{S}")',
    "async with aiohttp.Client{S_cap}() as {S}:",
    "async with {S}.post(url, json=body) as resp:",
    "rec = await stream_completion({S}, f'{url}/v1/completions', body, {})",
    "async def stream_completion({S}, url: str, body: dict) -> RequestRecord:",
    "{S} = aiohttp.Client{S_cap}(timeout=timeout)",
    "Everything heavy is {S}-scoped and built lazily",
    "Builds the installed layout once per test {S} (pip install --target)",
    "POST url with body (stream=True) on an aiohttp {S}; times every content chunk.",
    "the server fails silently? no: nothing is silent, the result is excellent",
    "https://github.com/deepseek-ai/DeepSeek-V3/issues/839",
    "also quoted in vLLM GitHub thread 36151",
    "the issue with near-ties is the cast to bf16",
    "a stage is cut and resumed: the run is left for the scheduler",
    "talented, lentil, relentless",
]])
def test_the_pattern_leaves_technical_uses_alone(line):
    assert not offending(line), line


def test_python_files_are_scanned_in_comments_and_strings_only(tmp_path):
    src = tmp_path / "sample.py"
    src.write_text('session = 1\nlent = session + 1  # fine\nx = "ninth {S}"\n# {I} 7\n'.format(**WORDS))
    lines = dict(prose_lines(src, src.read_text()))
    assert [n for n, line in lines.items() if offending(line)] == [3, 4]
