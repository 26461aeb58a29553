"""Train the draft model: a small Llama on the same tokenizer and corpus, <= 1/8 of the target's per-token
compute (checked by tests/test_training_target.py); export to models/draft.

    python -m training.train_draft --minutes 15 --threads 2      # resumable; rerun to continue
"""
from __future__ import annotations

import argparse

from training.common import REPO
from training.lm_loop import LMTrainConfig, add_common_args, config_from_args, train_lm
from training.model import LlamaSpec

# 2.75M params incl. its 1.57M lm_head; fwd 5.5 MFLOP/token = 1/8 of the target's 44 MFLOP.
DRAFT = LlamaSpec(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=3,
                  num_key_value_heads=1)

DEFAULTS = LMTrainConfig(name="draft", spec=DRAFT, out_dir=REPO / "models" / "draft", batch_size=16, seq_len=256,
                         lr=3e-3, warmup_steps=50, decay_frac=0.2, weight_decay=0.1, mtp_weight=0.0,
                         threads=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, DEFAULTS)
    train_lm(config_from_args(ap.parse_args(argv), DRAFT))


if __name__ == "__main__":
    main()
