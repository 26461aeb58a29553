"""A bounded index of token sequences that finds where the end of a context occurred before, in O(match).

Layout (numpy, flat arrays; memory per cached token: 4 B token + 4 B scope + 8 B per level of chain, plus
the level heads, about 90 B in all):

    tokens[slot]          ring buffer of token ids; slot = absolute position % capacity; -1 separates documents
    scope[slot]           which cache scope wrote the token (cross-request isolation)
    head[level][bucket]   latest absolute end position of an n-gram (n = LEVELS[level]) hashing to bucket
    prev[level][slot]     the previous end position in the same bucket (a hash chain, as LZ77 compressors keep)

Appending a token inserts it at the head of one chain per level, so an update costs O(levels) per new token,
never a pass over the history. A lookup hashes the last n tokens of the context for n = 32, 16, ... 2, walks
at most MAX_CHAIN entries of that chain, and keeps the positions whose n tokens really match (a bucket may
hold other n-grams). The first level with matches gives the candidates; the draft follows their
continuations, taking at each position the token most of the still-agreeing candidates continue with (the
most frequent continuation of the longest match). The loops are compiled (speculators/suffix_kernels.py):
one call per append and one per lookup.

Eviction is the ring: writing past the capacity overwrites the oldest tokens, and a chain walk stops at
the first position older than the oldest kept one (positions only decrease along a chain).

Worked example, capacity 16, tokens [5 1 2 3 -1 9 1 2 3 7] (two documents), context tail [.., 1, 2]:
level 2 hashes (1, 2): its chain holds end positions 7 and 2, both match; continuations are 3 (from 8)
and 3 (from 3) -> draft 3 with frequency 1.0; next, 7 (from 9) and -1 (end of document at 4): 7 has
frequency 0.5.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specserve.speculators import suffix_kernels as kernels
from specserve.speculators.suffix_kernels import LEVELS, MAX_CHAIN, MAX_MATCH, SEPARATOR, salt

__all__ = ["LEVELS", "MAX_MATCH", "SEPARATOR", "Match", "SuffixIndex", "warm"]


@dataclass
class Match:
    """Where the context's end occurred: candidate end positions (absolute) and the longest length."""
    ends: np.ndarray         # [C] int64 absolute positions of the last matched token, newest first
    length: int              # longest verified match length among them (<= MAX_MATCH)


class SuffixIndex:
    """Token sequences of bounded total length, indexed for longest-suffix lookup.

    growable=True: the index never evicts and doubles its capacity when full (a request's own context);
    growable=False: a fixed budget that overwrites the oldest tokens (the cross-request cache).
    """

    def __init__(self, capacity: int, growable: bool = False) -> None:
        self.growable = growable
        self.end = 0                                   # absolute position of the next token
        self._ends = np.empty(MAX_CHAIN, dtype=np.int64)       # a lookup's candidates   [MAX_CHAIN]
        self._out = np.empty(MAX_MATCH, dtype=np.int64)        # a lookup's draft        [MAX_MATCH]
        self._alloc(max(16, int(capacity)))

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = np.full(capacity, SEPARATOR, dtype=np.int32)       # [capacity]
        self.scope = np.zeros(capacity, dtype=np.int32)                  # [capacity]
        buckets = 1 << max(4, (capacity - 1).bit_length())
        self.mask = np.uint64(buckets - 1)
        self.head = np.full((len(LEVELS), buckets), -1, dtype=np.int64)  # [levels, buckets]
        self.prev = np.full((len(LEVELS), capacity), -1, dtype=np.int64)  # [levels, capacity]

    @property
    def oldest(self) -> int:
        """The oldest absolute position still held."""
        return max(0, self.end - self.capacity)

    @property
    def size(self) -> int:
        return self.end - self.oldest

    def nbytes(self) -> int:
        return self.tokens.nbytes + self.scope.nbytes + self.head.nbytes + self.prev.nbytes

    # -- writing -------------------------------------------------------------------------------------
    def extend(self, tokens, scope: int = 0) -> None:
        """Append tokens (a separator is SEPARATOR) written by `scope`; index every n-gram they end."""
        new = np.asarray(tokens, dtype=np.int32)                         # [B]
        if len(new) == 0:
            return
        if self.growable and self.end + len(new) > self.capacity:
            self._grow(self.end + len(new))
        if len(new) > self.capacity:                                     # only the newest fit
            self.end += len(new) - self.capacity
            new = new[-self.capacity:]
        self.end = kernels.append(self.tokens, self.scope, self.head, self.prev, self.mask, self.end, new,
                                  np.int32(scope), salt(scope))

    def tail(self, m: int) -> np.ndarray:
        """The last min(m, held) tokens ([T] int32), oldest first."""
        m = min(m, self.size)
        lo, hi = (self.end - m) % self.capacity, self.end % self.capacity
        if m and lo < hi:                                                 # no wrap: a slice
            return self.tokens[lo:hi]
        return self.tokens[np.arange(self.end - m, self.end) % self.capacity]

    def _grow(self, need: int) -> None:
        held = self.tokens[np.arange(self.oldest, self.end) % self.capacity].copy()
        scopes = self.scope[np.arange(self.oldest, self.end) % self.capacity].copy()
        self.end = 0
        self._alloc(max(need, 2 * self.capacity))
        for s in np.unique(scopes):                                      # one scope for a request's index
            self.extend(held, int(s))

    # -- reading -------------------------------------------------------------------------------------
    def draft(self, tail: np.ndarray, scope: int, k: int, factor: float, min_prob: float,
              before: int | None = None) -> tuple[list[int], float]:
        """The most frequent continuation of tail's longest match (match + continuation in one compiled call):
        up to min(k, max(1, int(factor x match length))) ids and their expected accepted length; ([], 0.0)
        without a match."""
        tail = np.asarray(tail, dtype=np.int32)
        n, expected = kernels.draft(self.tokens, self.scope, self.head, self.prev, self.mask, self.oldest,
                                    self.end if before is None else before, tail, np.int32(scope), salt(scope),
                                    k, float(factor), float(min_prob), self._ends, self._out)
        return self._out[:n].tolist(), expected

    def match(self, tail: np.ndarray, scope: int = 0, before: int | None = None,
              enough: int = MAX_MATCH) -> Match | None:
        """Candidates whose tokens end like `tail` ([T] ints), written by `scope`, with at least one token
        after them before absolute position `before` (default: the end). None: no match of >= 2 tokens.
        enough: the match length is measured up to this (a draft-length rule that stops growing there needs
        no more; a level this long is not re-measured)."""
        tail = np.asarray(tail, dtype=np.int32)
        count, length = kernels.match(self.tokens, self.scope, self.head, self.prev, self.mask, self.oldest,
                                      self.end if before is None else before, tail, np.int32(scope), salt(scope),
                                      enough, self._ends)
        return Match(self._ends[:count].copy(), length) if count else None

    def continuation(self, found: Match, max_len: int, min_prob: float,
                     before: int | None = None) -> tuple[list[int], float]:
        """Follow the candidates: at each position the most frequent next token among those still agreeing,
        stopping when the path's probability (product of frequencies) falls below min_prob.
        Returns (draft ids, expected accepted tokens under those frequencies)."""
        out = np.empty(max(max_len, 0), dtype=np.int64)
        n, expected = kernels.follow(self.tokens, found.ends, len(found.ends), self.end if before is None else before,
                                     max_len, float(min_prob), out)
        return out[:n].tolist(), expected


def warm() -> None:
    """Compile the engine's kernels now (or load them from the cache), not in the first request's step."""
    index = SuffixIndex(64)
    index.extend([1, 2, 3, 4, SEPARATOR, 1, 2, 3, 5], 1)
    index.draft(index.tail(3), 1, 4, 1.0, 0.1)
