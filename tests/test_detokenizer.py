"""IncrementalDetokenizer: streamed pieces never split a character, and the final text is decode(all ids)."""
import pytest

from specserve.server.engine.detokenizer import IncrementalDetokenizer
from specserve.server.engine.tokenizer import Tokenizer
from specserve.server.models.embedded import require as embedded_family

TEXT = "naïve café — 東京 🚀 ok"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(str(embedded_family().tokenizer))


def stream(tok, ids, stop=(), include_stop=False):
    detok = IncrementalDetokenizer(tok, list(stop), include_stop)
    pieces, hit = [], None
    for i, t in enumerate(ids):
        hit = detok.append(t)
        last = hit is not None or i == len(ids) - 1
        pieces.append(detok.delta(finished=last))
        if hit is not None:
            break
    return pieces, hit


def test_pieces_join_to_full_decode_and_never_split_a_character(tok):
    ids = tok.encode(TEXT)
    assert any("\ufffd" in tok.token_str(i) for i in ids)     # the text does split characters over tokens
    pieces, hit = stream(tok, ids)
    assert hit is None and "".join(pieces) == TEXT == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_finishing_inside_a_character_flushes_it_as_replacement(tok, cut):
    ids = tok.encode("ok 🚀")
    ids = ids[:len(ids) - cut]                                # stop 1-3 bytes short of the rocket
    pieces, _ = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert pieces[-1].endswith("\ufffd") and not any("\ufffd" in p for p in pieces[:-1])


def test_stop_string_across_tokens_is_held_back_then_cut(tok):
    ids = tok.encode("x = 1\n\ny = 2")
    pieces, hit = stream(tok, ids, stop=["\n\n"])
    assert hit == "\n\n" and "".join(pieces) == "x = 1"
    pieces, hit = stream(tok, ids, stop=["\n\n"], include_stop=True)
    assert hit == "\n\n" and "".join(pieces) == "x = 1\n\n"
