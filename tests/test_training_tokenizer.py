"""The shipped tokenizer (models/tokenizer): byte-level round trip, eos, chat template."""
from pathlib import Path

import pytest
from transformers import AutoTokenizer

TOK_DIR = Path(__file__).resolve().parent.parent / "models" / "tokenizer"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(TOK_DIR))


SAMPLES = [
    "def f(x):\n    return x + 1\n",
    "héllo wörld — naïve café ñ ß ø",
    "emoji 🎉👩‍👩‍👧 flags 🇫🇷 and CJK 中文字符 日本語 한국어",
    "tabs\tand\r\nCRLF\n\n\n   trailing   ",
    "\x00\x01\x7f control \u200b zero-width \ufeff bom",
    "",
    " leading space",
    "literal <|endoftext|> inside text <|user|>",
]


@pytest.mark.parametrize("s", SAMPLES)
def test_round_trip(tok, s):
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_round_trip_random_unicode(tok):
    import random
    rng = random.Random(0)
    for _ in range(50):
        s = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x800),
                                     rng.randrange(0x800, 0xD800), rng.randrange(0x10000, 0x10FFFF)]))
                    for _ in range(rng.randrange(1, 40)))
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_special_tokens(tok):
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert len(tok) == 8192
    for t in ("<|system|>", "<|user|>", "<|assistant|>"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    assert tok.encode("x = 1", add_special_tokens=True) == tok.encode("x = 1", add_special_tokens=False)


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a list"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>\nbe brief<|endoftext|><|user|>\nsort a list<|endoftext|><|assistant|>\n"
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "sorted(x)"}], tokenize=False)
    assert full.endswith("<|assistant|>\nsorted(x)" + tok.eos_token)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tok.convert_tokens_to_ids("<|system|>")


def test_code_compresses(tok):
    src = "    def __init__(self, name):\n        self.name = name\n"
    assert len(tok.encode(src)) <= 18
