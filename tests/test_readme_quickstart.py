"""The README's quick-start client snippet runs as printed against a live server.

The first ```python block after the "Quick start" heading of README.md is run with this interpreter (the
venv's, which has the `openai` client) against the suite's shared test server; the only change made to it is
its base_url. It must exit 0 and print the completion's text and the response's `speculation` object.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

from conftest import REPO, SERVED_NAME

README = REPO / "README.md"
README_URL = "http://127.0.0.1:8000/v1"
PROMPT = "def fibonacci(n):"


def quickstart_snippet() -> str:
    text = README.read_text(encoding="utf-8")
    heading = re.search(r"^#+\s*Quick start\s*$", text, re.MULTILINE | re.IGNORECASE)
    assert heading, "README.md has no 'Quick start' heading"
    block = re.search(r"^```python\n(.*?)^```", text[heading.end():], re.MULTILINE | re.DOTALL)
    assert block, "no ```python block after the Quick start heading"
    return block.group(1)


def printed_dicts(stdout: str) -> list[dict]:
    found = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = ast.literal_eval(line)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, dict):
                found.append(value)
    return found


def test_snippet_is_the_documented_call():
    snippet = quickstart_snippet()
    assert snippet.count(README_URL) == 1, "the snippet should name the server's URL exactly once"
    assert "from openai import OpenAI" in snippet and "client.completions.create(" in snippet
    assert f'prompt="{PROMPT}"' in snippet and "max_tokens=64" in snippet and "temperature=0" in snippet
    assert "chat.completions.create(" in snippet and "extra_body=" in snippet


def test_quickstart_snippet_runs_against_a_live_server(server_url, client, tmp_path):
    snippet = quickstart_snippet().replace(README_URL, f"{server_url}/v1")
    script = tmp_path / "quickstart.py"
    script.write_text(snippet, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")} | {"PYTHONIOENCODING": "utf-8"}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, timeout=300)
    stdout, stderr = run.stdout.decode("utf-8"), run.stderr.decode("utf-8", "replace")
    assert run.returncode == 0, f"snippet exited {run.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr[-4000:]}"

    # the same greedy request, made here: its text is what the snippet must have printed
    expected = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=64, temperature=0)
    text = expected.choices[0].text
    assert text.strip(), "the test server returned an empty completion; the check below would prove nothing"
    assert text in stdout, f"completion text not printed\nexpected:\n{text!r}\nstdout:\n{stdout}"

    stats = [d for d in printed_dicts(stdout) if "method" in d]
    assert stats, f"no speculation object (a dict with 'method') printed:\n{stdout}"
    assert isinstance(stats[0]["method"], str) and "num_speculative_tokens" in stats[0], stats[0]
    # the README's last line compares greedy output with speculation off: it says True
    assert stdout.rstrip().splitlines()[-1] == "True", stdout
