"""The attention backends' names and the devices each runs on (no torch import: the CLI validates flags with
them before loading anything). attention.py picks among them; config.py checks --attention-backend."""
from __future__ import annotations

ATTENTION_BACKENDS = ("auto", "sdpa", "paged", "triton", "flash")
DEVICE_BACKENDS = {"cpu": ("paged", "sdpa"), "cuda": ("triton", "flash", "sdpa")}
