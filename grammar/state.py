"""GrammarState: one request's position in its grammar, and the masks of a step's draft positions.

The matcher always sits at committed output + `pending`, a prefix of the drafts being looked at. Masks
for a step with drafts [d_0 .. d_{k-1}] are computed by walking the matcher through them: row j is the
mask after d_0 .. d_{j-1}. At the first draft the grammar forbids, the walk stops; that draft gets
target probability 0 in its row and is rejected there, so the rows after it are never read (they are
left all-allowed). A draft that completes the constraint ends the request (server/engine/engine.py), so
the drafts after it are not looked at either. After the step the drafts are rolled back and the emitted
tokens committed.

Worked example: regex "ab", drafts [a, x, b]: row 0 allows {a}; a is valid, row 1 allows {b}; x is not,
walk stops with n_valid = 1; row 2 and 3 all-allowed (never read). The verifier rejects x at row 1 and
draws from row 1's masked distribution, i.e. b.
"""
from __future__ import annotations

import numpy as np
import torch

from specserve.grammar.backend import Matcher


class GrammarState:
    def __init__(self, matcher: Matcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._pending: list[int] = []     # draft tokens the matcher has consumed beyond the committed output

    @property
    def is_finished(self) -> bool:
        """The committed output completes the constraint (only valid once nothing is pending)."""
        return not self._pending and self._m.is_finished

    def _walk_to(self, prefix: list[int]) -> bool:
        """Make `pending` equal `prefix` (reusing the common start); False if the grammar forbids part of it,
        in which case pending stops at its longest valid prefix."""
        common = 0
        limit = min(len(prefix), len(self._pending))
        while common < limit and prefix[common] == self._pending[common]:
            common += 1
        if common < len(self._pending):
            self._m.rollback(len(self._pending) - common)
            del self._pending[common:]
        rest = list(prefix[common:])
        if not rest:
            return True
        n = self._m.valid_prefix(rest)
        self._m.consume(rest[:n])
        self._pending.extend(rest[:n])
        return n == len(rest)

    def _unpack(self, bitmask: np.ndarray) -> torch.Tensor:   # bitmask [rows, words] int32
        """[rows, vocab] bool."""
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        return torch.from_numpy(bits.view(np.bool_))

    def row_masks(self, drafts: list[int]) -> tuple[torch.Tensor, int]:
        """([len(drafts) + 1, vocab] bool allowed tokens per verification row, leading grammar-valid drafts)."""
        bitmask = np.full((len(drafts) + 1, self._words), -1, dtype=np.int32)
        self._walk_to([])
        self._m.fill_mask(bitmask[0])
        n_valid = len(drafts)
        for j in range(1, len(drafts) + 1):
            if not self._walk_to(drafts[:j]):
                n_valid = j - 1
                break
            if self._m.is_finished:      # drafts[j - 1] completes the output: the request ends there
                break
            self._m.fill_mask(bitmask[j])
        return self._unpack(bitmask), n_valid

    def draft_mask(self, prefix: list[int]) -> torch.Tensor | None:
        """[vocab] bool allowed tokens after committed output + prefix (a drafter's next position), or None
        when nothing after the prefix can be accepted: the grammar forbids the prefix, or the prefix completes
        the constraint (the request ends there, so a draft after it is never used)."""
        if not self._walk_to(prefix) or self._m.is_finished:
            return None
        bitmask = np.empty((1, self._words), dtype=np.int32)
        self._m.fill_mask(bitmask[0])
        return self._unpack(bitmask)[0]

    def commit(self, tokens: list[int]) -> None:
        """The step emitted `tokens`: forget the drafts, advance over what was emitted.

        Emitted tokens come from masked rows, so all are valid; a stop token the engine emits after the
        constraint completed (ignore_eos) is the one exception, and is simply not consumed."""
        self._walk_to([])
        n = self._m.valid_prefix(tokens)
        self._m.consume(tokens[:n])
