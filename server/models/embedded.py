"""Where the embedded model family (models/: target, draft, eagle3, tokenizer) lives.

One explicit rule, first match wins:
  1. the `--models-dir` flag (EngineConfig.models_dir),
  2. the environment variable SPECSERVE_MODELS_DIR,
  3. the source checkout this distribution was installed from in editable mode (`make venv`), read from
     the installer's own record (PEP 610 direct_url.json), so a wheel installed elsewhere never guesses,
  4. none: the server then needs `--model` (or serves the random stand-in, with a warning).
A directory counts only if it holds `tokenizer/tokenizer.json`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

ENV_VAR = "SPECSERVE_MODELS_DIR"


@dataclass(frozen=True)
class EmbeddedFamily:
    root: Path

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def draft(self) -> Path:
        return self.root / "draft"

    @property
    def eagle3(self) -> Path:
        return self.root / "eagle3"

    @property
    def eagle(self) -> Path:
        """The EAGLE-1 head."""
        return self.root / "eagle"

    def has(self, member: str) -> bool:
        return (getattr(self, member) / "config.json").is_file()


def editable_checkout() -> Path | None:
    """The project directory of an editable install of `specserve`, from PEP 610's direct_url.json."""
    # the installed record Python imports from: the first .dist-info on sys.path (a checkout's own
    # specserve.egg-info, left by setuptools, is not an install record)
    dists = [d for d in metadata.distributions(name="specserve") if ".egg-info" not in str(getattr(d, "_path", ""))]
    text = dists[0].read_text("direct_url.json") if dists else None
    if not text:
        return None
    info = json.loads(text)
    if not info.get("dir_info", {}).get("editable"):
        return None
    url = urlparse(info.get("url", ""))
    return Path(unquote(url.path)) if url.scheme == "file" else None


def _valid(root: Path) -> bool:
    return (root / "tokenizer" / "tokenizer.json").is_file()


def locate(flag: str | None = None) -> EmbeddedFamily | None:
    """The embedded family by the rule above; a flag or env var naming a bad directory is an error."""
    for source, value in (("--models-dir", flag), (ENV_VAR, os.environ.get(ENV_VAR))):
        if value:
            root = Path(value).expanduser()
            if not _valid(root):
                raise ValueError(f"{source} {root}: no embedded model family there "
                                 "(expected tokenizer/tokenizer.json, and target/, draft/, eagle3/)")
            return EmbeddedFamily(root)
    checkout = editable_checkout()
    if checkout is not None and _valid(checkout / "models"):
        return EmbeddedFamily(checkout / "models")
    return None


def require(flag: str | None = None) -> EmbeddedFamily:
    family = locate(flag)
    if family is None:
        raise ValueError(f"the embedded model family was not found: pass --models-dir DIR or set {ENV_VAR} "
                         "(a checkout's models/ folder), or serve another model with --model DIR")
    return family
