"""Tokenizer facade over the `tokenizers` library, reading the HF layout directly.

Why not transformers' AutoTokenizer: importing transformers costs seconds at every server start, and
we need only tokenizer.json, tokenizer_config.json (special tokens, chat template) and the EOS ids.
Chat templates render in a sandboxed Jinja environment configured like HF's (trim_blocks,
lstrip_blocks, raise_exception), so templates written for HF work unchanged. No remote code.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _token_text(value: Any) -> str | None:
    """Special tokens appear as strings or as serialized AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class Tokenizer:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(f"{root}: no tokenizer.json (a fast tokenizer file is required)")
        self._tok = HFTokenizer.from_file(str(root / "tokenizer.json"))
        self._tok.no_padding()
        self._tok.no_truncation()
        cfg = _read_json(root / "tokenizer_config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_ids = self._eos_ids(root, cfg)
        self._special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.chat_template = self._load_template(root, cfg)
        self._template = None
        self._byte_decoder: dict[str, int] | None = None

    def _eos_ids(self, root: Path, cfg: dict) -> list[int]:
        ids: set[int] = set()
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            ids.add(self._tok.token_to_id(self.eos_token))
        for extra in (_read_json(root / "generation_config.json").get("eos_token_id"),
                      _read_json(root / "config.json").get("eos_token_id")):
            if isinstance(extra, int):
                ids.add(extra)
            elif isinstance(extra, list):
                ids.update(int(i) for i in extra)
        return sorted(ids)

    @staticmethod
    def _load_template(root: Path, cfg: dict) -> str | None:
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):       # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        return tmpl if isinstance(tmpl, str) else None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_str(self, token_id: int) -> str:
        """Human-readable text of one token (partial UTF-8 shows as U+FFFD)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """Raw bytes of one token (byte-level BPE), for the chat logprobs `bytes` field."""
        tok = self._tok.id_to_token(token_id)
        if tok is None:
            return []
        if self._byte_decoder is None:
            self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        if all(c in self._byte_decoder for c in tok):
            return [self._byte_decoder[c] for c in tok]
        return list(tok.encode("utf-8"))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """`tools`: OpenAI-shaped function definitions, which templates that know tools render (HF's
        convention: the template reads a `tools` variable, None when the request has none)."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     tools=tools)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _compile_template(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        undefined=jinja2.Undefined)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the model's chat template does not compile: {exc}") from exc


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-unicode table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table
