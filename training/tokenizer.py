"""Byte-level BPE tokenizer for the embedded model family, trained on the corpus' train split.

Byte-level (GPT-2 style byte-to-unicode alphabet, no normalizer, no prefix space) so that any
string, any UTF-8 and any emoji round-trips: decode(encode(s)) == s.

Special tokens (fixed ids, first in the vocabulary):
  0 <|endoftext|>  end of a document; also bos, eos and pad
  1 <|system|>  2 <|user|>  3 <|assistant|>   chat roles
The chat template renders every message as `<|role|>\\n{content}<|endoftext|>` and the generation
prompt as `<|assistant|>\\n`, so an assistant turn ends with the eos token, which the model learns
from the corpus (every file ends with it).

Worked example: [{"role": "user", "content": "hi"}] with add_generation_prompt=True renders
"<|user|>\\nhi<|endoftext|><|assistant|>\\n".
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.corpus import EOT, load_corpus

VOCAB_SIZE = 8192
SPECIAL_TOKENS = [EOT, "<|system|>", "<|user|>", "<|assistant|>"]
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "models" / "tokenizer"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|endoftext|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_tokenizer(texts, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train byte-level BPE on an iterable of documents (deterministic for a fixed input)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
    }


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    special = {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT,
               "additional_special_tokens": SPECIAL_TOKENS[1:]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="train the byte-level BPE tokenizer")
    ap.add_argument("--out", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    corpus = load_corpus()
    tok = build_tokenizer(corpus.train_texts(), args.vocab_size)
    save_tokenizer(tok, args.out)
    digest = hashlib.sha256((args.out / "tokenizer.json").read_bytes()).hexdigest()
    print(f"saved {args.out} vocab={tok.get_vocab_size()} sha256={digest[:16]}")


if __name__ == "__main__":
    main()
