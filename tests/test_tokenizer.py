"""Our tokenizer facade agrees with transformers' AutoTokenizer on the shipped tokenizer."""
import pytest

from specserve.server.engine.tokenizer import Tokenizer
from specserve.server.models.embedded import require as embedded_family

TEXTS = ["def f(x):\n    return x  # ok\n", "naïve café — 東京 🚀", "", "a\x00b", "<|endoftext|> literal"]


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoTokenizer
    return Tokenizer(str(embedded_family().tokenizer)), AutoTokenizer.from_pretrained(str(embedded_family().tokenizer))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(pair, text):
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_hf(pair):
    ours, hf = pair
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    for gen in (True, False):
        expected = hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        assert ours.render_chat(msgs, gen) == expected
        assert ours.apply_chat_template(msgs, gen) == hf.encode(expected, add_special_tokens=False)


def test_special_tokens_and_sizes(pair):
    ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert ours.eos_token_ids == [hf.eos_token_id]
    assert ours.is_special(hf.eos_token_id)
    assert bytes(ours.token_bytes(ours.encode("é")[0])).decode("utf-8", "replace")


def test_template_errors_are_value_errors(tmp_path):
    import shutil
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_family().tokenizer / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    tok = Tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="no system role"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
