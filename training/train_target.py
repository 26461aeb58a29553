"""Train the target: a Llama (GQA) jointly with one DeepSeek-style MTP module; export to models/target.

    python -m training.train_target --minutes 110 --threads 2       # resumable; rerun to continue
    python -m training.train_target --preset proxy --tokens 5e5 --no-export --name tune-x   # tuning runs
"""
from __future__ import annotations

import argparse

from training.common import REPO
from training.lm_loop import LMTrainConfig, add_common_args, config_from_args, train_lm
from training.model import LlamaSpec

PRESETS = {
    # 26.2M main params (+2.7M MTP), fwd 44 MFLOP/token; EAGLE-3 taps layers (2, 4, 5).
    "target": LlamaSpec(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=2, num_nextn_predict_layers=1),
    # small stand-in used to tune lr/schedule on short single-thread runs
    "proxy": LlamaSpec(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=2,
                       num_key_value_heads=1, num_nextn_predict_layers=1),
    # unit tests
    "tiny": LlamaSpec(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, num_nextn_predict_layers=1),
}

DEFAULTS = LMTrainConfig(name="target", spec=PRESETS["target"], out_dir=REPO / "models" / "target",
                         batch_size=16, seq_len=256, lr=2e-3, warmup_steps=50, decay_frac=0.2,
                         weight_decay=0.1, mtp_weight=0.3, threads=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="target")
    ap.add_argument("--no-mtp", action="store_true", help="train without the MTP module (ablation)")
    add_common_args(ap, DEFAULTS)
    args = ap.parse_args(argv)
    spec = PRESETS[args.preset]
    if args.no_mtp:
        spec = LlamaSpec(**{**spec.to_dict(), "num_nextn_predict_layers": 0})
    train_lm(config_from_args(args, spec))


if __name__ == "__main__":
    main()
