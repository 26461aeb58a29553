"""Train the EAGLE-1 head on the frozen target and export it to models/eagle (SafeAILab EAGLE-1 layout).
The loop, data and loss are training/train_eagle3.py's (`--head eagle1`); see training/eagle1.py.

    python -m training.train_eagle1 --target models/target --tokens 3e6 --threads 1   # resumable
"""
from __future__ import annotations

from training import train_eagle3


def main(argv=None):
    return train_eagle3.main(argv, head="eagle1")


if __name__ == "__main__":
    main()
