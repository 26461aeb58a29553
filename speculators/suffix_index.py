"""A bounded index of token sequences that finds where the end of a context occurred before, in O(match).

Layout (numpy, flat arrays; memory per cached token: 4 B token + 4 B scope + 8 B per level of chain, plus
the level heads, about 90 B in all):

    tokens[slot]          ring buffer of token ids; slot = absolute position % capacity; -1 separates documents
    scope[slot]           which cache scope wrote the token (cross-request isolation)
    head[level][bucket]   latest absolute end position of an n-gram (n = LEVELS[level]) hashing to bucket
    prev[level][slot]     the previous end position in the same bucket (a hash chain, as LZ77 compressors keep)

Appending a token inserts it at the head of one chain per level (vectorised per batch of tokens), so an
update costs O(levels) per new token, never a pass over the history. A lookup hashes the last n tokens
of the context for n = 32, 16, ... 2, walks at most MAX_CHAIN entries of that chain, and keeps the
positions whose n tokens really match (a bucket may hold other n-grams). The first level with matches
gives the candidates; the draft follows their continuations, taking at each position the token most of
the still-agreeing candidates continue with (the most frequent continuation of the longest match).

Eviction is the ring: writing past the capacity overwrites the oldest tokens, and a chain walk stops at
the first position older than the oldest kept one (positions only decrease along a chain).

Worked example, capacity 16, tokens [5 1 2 3 -1 9 1 2 3 7] (two documents), context tail [.., 1, 2]:
level 2 hashes (1, 2): its chain holds end positions 7 and 2, both match; continuations are 3 (from 8)
and 3 (from 3) -> draft 3 with frequency 1.0; next, 7 (from 9) and -1 (end of document at 4): 7 has
frequency 0.5.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

LEVELS = (32, 16, 8, 4, 2)      # n-gram lengths indexed, longest first
MAX_MATCH = 64                 # longest match length measured (caps the draft-length rule)
MAX_CHAIN = 32                 # chain entries examined per level and lookup (bounds the work)
SHORT_CHAIN = 8                # chains up to this long are checked in Python (numpy's per-call cost dominates)
SHORT_WALK = 96                # match lengths are measured in Python up to this many token comparisons
SEPARATOR = -1
_BASE = np.uint64(0x100000001B3)
_MIX = np.uint64(0x9E3779B97F4A7C15)
_POWERS = {n: _BASE ** np.arange(n - 1, -1, -1, dtype=np.uint64) for n in LEVELS}   # [n] uint64
# The same hash in Python ints, for the few tokens a decode step appends and the one tail a lookup hashes:
# there numpy's per-call overhead (~1 µs per operation, dozens per level) costs more than the arithmetic.
SMALL = 16                     # extend() appends up to this many tokens without numpy
_M64 = (1 << 64) - 1
_POWERS_INT = {n: [int(x) for x in _POWERS[n]] for n in LEVELS}
_MIX_INT = int(_MIX)
# A request's own (growable) index also keeps prefix hashes P[j] = sum over i < j of (t_i + 2) B^(j-1-i):
# the hash of the n tokens ending at position p is then P[p+1] - P[p+1-n] B^n (mod 2^64), O(1) per level
# where hashing the window costs n steps (a decode step's append went from ~60 µs to ~15 µs).
_BASE_INT = int(_BASE)
_BASE_POW = {n: pow(_BASE_INT, n, 1 << 64) for n in LEVELS}


@dataclass
class Match:
    """Where the context's end occurred: candidate end positions (absolute) and the longest length."""
    ends: np.ndarray         # [C] int64 absolute positions of the last matched token
    length: int              # longest verified match length among them (<= MAX_MATCH)


def _hash(windows: np.ndarray, n: int, salt: int) -> np.ndarray:
    """windows: [B, n] int64 tokens -> [B] uint64 hash (wrapping arithmetic), salted by the scope."""
    with np.errstate(over="ignore"):
        h = ((windows.astype(np.uint64) + np.uint64(2)) * _POWERS[n]).sum(axis=1, dtype=np.uint64)
        return h ^ (np.uint64(salt) * _MIX)


def _hash_one(window: list[int], n: int, salt: int) -> int:
    """_hash of one window, in Python ints (equal to the numpy version, tests/test_spec_suffix.py)."""
    h = 0
    for t, p in zip(window, _POWERS_INT[n]):
        h += (t + 2) * p
    return (h & _M64) ^ ((salt * _MIX_INT) & _M64)


def _salt(scope: int) -> int:
    return (scope * _MIX_INT) & _M64


class SuffixIndex:
    """Token sequences of bounded total length, indexed for longest-suffix lookup.

    growable=True: the index never evicts and doubles its capacity when full (a request's own context);
    growable=False: a fixed budget that overwrites the oldest tokens (the cross-request cache).
    """

    def __init__(self, capacity: int, growable: bool = False) -> None:
        self.growable = growable
        self.end = 0                                   # absolute position of the next token
        self._alloc(max(16, int(capacity)))

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = np.full(capacity, SEPARATOR, dtype=np.int32)       # [capacity]
        self.scope = np.zeros(capacity, dtype=np.int32)                  # [capacity]
        buckets = 1 << max(4, (capacity - 1).bit_length())
        self.mask = np.uint64(buckets - 1)
        self.head = np.full((len(LEVELS), buckets), -1, dtype=np.int64)  # [levels, buckets]
        self.prev = np.full((len(LEVELS), capacity), -1, dtype=np.int64)  # [levels, capacity]
        self._prefix: list[int] | None = [0] if self.growable else None   # P[0 .. end] (growable: no eviction)
        self._last_sep = -1                            # absolute position of the latest separator (growable)

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
        new = np.asarray(tokens, dtype=np.int64)                         # [B]
        if len(new) == 0:
            return
        if self.growable and self.end + len(new) > self.capacity:
            self._grow(self.end + len(new))
        if len(new) > self.capacity:                                     # only the newest fit
            self.end += len(new) - self.capacity
            new = new[-self.capacity:]
        if len(new) <= SMALL:
            if self._prefix is not None:
                self._extend_rolling(new.tolist(), scope)
            else:
                self._extend_small(new.tolist(), scope)
            return
        if self._prefix is not None:
            self._extend_prefix(new.tolist())
        start = self.end
        pos = np.arange(start, start + len(new), dtype=np.int64)         # [B] absolute positions
        self.tokens[pos % self.capacity] = new
        self.scope[pos % self.capacity] = scope
        self.end = start + len(new)
        for li, n in enumerate(LEVELS):
            ends = pos[pos - n + 1 >= max(self.oldest, 0)]               # windows fully held
            if len(ends) == 0:
                continue
            win = self.tokens[(ends[:, None] - np.arange(n - 1, -1, -1)) % self.capacity]   # [E, n]
            ok = (win >= 0).all(axis=1)                                   # no window spans a separator
            ends, win = ends[ok], win[ok]
            if len(ends):
                self._link(li, (_hash(win, n, scope) & self.mask).astype(np.int64), ends)

    def _extend_small(self, new: list[int], scope: int) -> None:
        """extend() for a few tokens: the same chains, built one window at a time in Python."""
        start, cap = self.end, self.capacity
        pos = np.arange(start, start + len(new), dtype=np.int64) % cap
        self.tokens[pos] = new
        self.scope[pos] = scope
        self.end = start + len(new)
        lo = max(self.oldest, start - LEVELS[0] + 1)                     # oldest token any window reads
        held = self.tokens[np.arange(lo, self.end) % cap].tolist()      # tokens lo .. end - 1
        mask = int(self.mask)
        for li, n in enumerate(LEVELS):
            head, prev = self.head[li], self.prev[li]
            for p in range(max(start, lo + n - 1), self.end):
                window = held[p - n + 1 - lo:p + 1 - lo]
                if min(window) < 0:                                       # spans a separator
                    continue
                b = _hash_one(window, n, scope) & mask
                prev[p % cap] = head[b]
                head[b] = p

    def _extend_prefix(self, new: list[int]) -> None:
        """Append the prefix hashes (and note separators) of tokens written at self.end - len(new) .. end - 1."""
        prefix, h = self._prefix, self._prefix[-1]
        for p, t in enumerate(new, len(prefix) - 1):
            h = (h * _BASE_INT + t + 2) & _M64
            prefix.append(h)
            if t < 0:
                self._last_sep = p

    def _extend_rolling(self, new: list[int], scope: int) -> None:
        """_extend_small for a growable index: each window's hash from the prefix hashes."""
        start = self.end
        self.tokens[start:start + len(new)] = new                         # growable: end <= capacity
        self.scope[start:start + len(new)] = scope
        self.end = start + len(new)
        prefix, salt, mask = self._prefix, _salt(scope), int(self.mask)
        levels = [(n, _BASE_POW[n], self.head[li], self.prev[li]) for li, n in enumerate(LEVELS)]   # row views
        for p, t in enumerate(new, start):
            h = (prefix[-1] * _BASE_INT + t + 2) & _M64
            prefix.append(h)
            if t < 0:
                self._last_sep = p
            for n, power, head, prev in levels:
                if p - n < self._last_sep:                                # too few tokens, or spans a separator
                    continue
                b = (((h - prefix[p + 1 - n] * power) & _M64) ^ salt) & mask
                prev[p] = head[b]
                head[b] = p

    def tail(self, m: int) -> np.ndarray:
        """The last min(m, held) tokens ([T] int64), oldest first."""
        m = min(m, self.size)
        lo, hi = (self.end - m) % self.capacity, self.end % self.capacity
        if m and lo < hi:                                                 # no wrap: a slice
            return self.tokens[lo:hi].astype(np.int64)
        return self.tokens[np.arange(self.end - m, self.end) % self.capacity].astype(np.int64)

    def end_hashes(self) -> dict[int, int]:
        """n -> the unsalted hash of the last n tokens, for the levels whose window the index holds without
        a separator: a lookup of this index's own end reuses them (growable indexes only; else {})."""
        if self._prefix is None:
            return {}
        prefix, end = self._prefix, self.end
        return {n: (prefix[end] - prefix[end - n] * _BASE_POW[n]) & _M64 for n in LEVELS if end - n > self._last_sep}

    def _link(self, li: int, buckets: np.ndarray, ends: np.ndarray) -> None:
        """Push ends (ascending) onto their buckets' chains; several may share a bucket within the batch."""
        order = np.argsort(buckets, kind="stable")                       # ascending ends within a bucket
        b, e = buckets[order], ends[order]
        first = np.ones(len(b), dtype=bool)
        first[1:] = b[1:] != b[:-1]
        prev = np.empty(len(b), dtype=np.int64)
        prev[first] = self.head[li, b[first]]
        prev[~first] = e[np.flatnonzero(~first) - 1]
        self.prev[li, e % self.capacity] = prev
        last = np.ones(len(b), dtype=bool)
        last[:-1] = b[:-1] != b[1:]
        self.head[li, b[last]] = e[last]

    def _grow(self, need: int) -> None:
        held = self.tokens[np.arange(self.oldest, self.end) % self.capacity].copy()
        scopes = self.scope[np.arange(self.oldest, self.end) % self.capacity].copy()
        self.end = 0
        self._alloc(max(need, 2 * self.capacity))
        for s in np.unique(scopes):                                      # one scope for a request's index
            self.extend(held, int(s))

    # -- reading -------------------------------------------------------------------------------------
    def match(self, tail: np.ndarray, scope: int = 0, before: int | None = None,
              hashes: dict[int, int] | None = None, enough: int = MAX_MATCH) -> Match | None:
        """Candidates whose tokens end like `tail` ([T] int64), written by `scope`, with at least one token
        after them before absolute position `before` (default: the end). None: no match of >= 2 tokens.
        hashes: n -> the unsalted hash of tail's last n tokens where known (end_hashes of the index whose
        end `tail` is), else each level hashes its window. enough: the match length is measured up to this
        (a draft-length rule that stops growing there needs no more; a level this long is not re-measured)."""
        limit = self.end if before is None else before
        head, prev, scope_of, cap = self.head, self.prev, self.scope, self.capacity
        tail_ids, mask, oldest = tail.tolist(), int(self.mask), self.oldest
        for li, n in enumerate(LEVELS):
            if len(tail) < n:
                continue
            want = tail[-n:]
            known = hashes.get(n) if hashes else None
            h = _hash_one(tail_ids[-n:], n, scope) if known is None else known ^ _salt(scope)
            p = int(head[li, h & mask])
            chain: list[int] = []
            while p >= oldest + n - 1 and len(chain) < MAX_CHAIN:
                chain.append(p)
                p = int(prev[li, p % cap])
            if not chain:
                continue
            few = self._verify_few(chain, tail_ids[-n:], scope, limit) if len(chain) <= SHORT_CHAIN else None
            if few is not None:                                           # checked without numpy
                if few:
                    ends = np.asarray(few, dtype=np.int64)
                    return Match(ends, n if n >= enough else self._longest(ends, tail, enough, n))
                continue
            ends = np.asarray(chain, dtype=np.int64)                      # [C] newest first
            win = self.tokens[(ends[:, None] - np.arange(n - 1, -1, -1)) % cap]   # [C, n]
            ok = (ends + 1 < limit) & (scope_of[ends % cap] == scope) & (win == want[None, :]).all(axis=1)
            if ok.any():
                return Match(ends[ok], n if n >= enough else self._longest(ends[ok], tail, enough, n))
        return None

    def _verify_few(self, chain: list[int], want: list[int], scope: int, limit: int) -> list[int] | None:
        """The chain entries whose n tokens are `want`, written by `scope`, with a token after them; None
        when a window wraps around the ring (the numpy check handles that)."""
        n, cap = len(want), self.capacity
        ok = []
        for e in chain:
            first, last = (e - n + 1) % cap, e % cap
            if first > last:
                return None
            if e + 1 < limit and self.scope[last] == scope and self.tokens[first:last + 1].tolist() == want:
                ok.append(e)
        return ok

    def _longest(self, ends: np.ndarray, tail: np.ndarray, enough: int = MAX_MATCH, known: int = 0) -> int:
        """The longest match among `ends` (up to `enough`), whose last `known` tokens are already verified."""
        m = min(len(tail), MAX_MATCH, enough)
        if len(ends) * (m - known) <= SHORT_WALK:                       # a few tokens to compare: Python
            tokens, cap, oldest, want = self.tokens, self.capacity, self.oldest, tail[::-1][:m].tolist()
            best = known
            for e in ends.tolist():
                length = known
                while length < m and e - length >= oldest and tokens[(e - length) % cap] == want[length]:
                    length += 1
                best = max(best, length)
            return best
        back = np.arange(m)                                               # [m] 0 = the last token
        idx = ends[:, None] - back[None, :]                               # [C, m]
        held = idx >= self.oldest
        same = held & (self.tokens[idx % self.capacity] == tail[::-1][:m][None, :])
        return int(np.cumprod(same, axis=1).sum(axis=1).max())

    def _following(self, ends: np.ndarray, max_len: int, limit: int) -> list[list[int]]:
        """The max_len tokens after each end (SEPARATOR from `limit` on): slices of the ring for a few
        candidates (numpy's per-call cost dominates there), one gather for many."""
        cap = self.capacity
        if len(ends) <= SHORT_CHAIN:
            rows = []
            for e in ends.tolist():
                lo, hi = e + 1, min(e + 1 + max_len, limit)
                if hi - 1 - lo >= cap - lo % cap:                        # wraps around the ring: gather
                    break
                got = self.tokens[lo % cap:lo % cap + max(hi - lo, 0)].tolist()
                rows.append(got + [SEPARATOR] * (max_len - len(got)))
            else:
                return rows
        idx = ends[:, None] + np.arange(1, max_len + 1)                   # [C, L]
        return np.where(idx < limit, self.tokens[idx % cap], SEPARATOR).tolist()

    def continuation(self, found: Match, max_len: int, min_prob: float,
                     before: int | None = None) -> tuple[list[int], float]:
        """Follow the candidates: at each position the most frequent next token among those still agreeing,
        stopping when the path's probability (product of frequencies) falls below min_prob.
        Returns (draft ids, expected accepted tokens under those frequencies)."""
        limit = self.end if before is None else before
        rows = self._following(found.ends, max_len, limit)                # [C][L]
        if all(r == rows[0] for r in rows):             # one continuation (or copies of it): frequency 1 throughout
            first = rows[0]
            out = first[:first.index(SEPARATOR)] if SEPARATOR in first else first
            return out, float(len(out))
        out: list[int] = []
        prob, expected = 1.0, 0.0
        for j in range(max_len):
            counts = Counter(r[j] for r in rows)
            counts.pop(SEPARATOR, None)                                   # an occurrence that ended
            if not counts:
                break
            top = max(counts.values())
            token = next(r[j] for r in rows if counts.get(r[j]) == top)   # ties: the most recent one
            prob *= top / len(rows)
            if prob < min_prob:
                break
            out.append(token)
            expected += prob
            rows = [r for r in rows if r[j] == token]
        return out, expected
