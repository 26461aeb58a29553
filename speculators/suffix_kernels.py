"""The suffix index's loops, compiled with numba (speculators/suffix_index.py owns the layout and says what
they compute). Each is one call per append or per lookup: inside the engine a lookup made in numpy and
Python cost 57-68 µs a request and step (~60 numpy calls of ~1 µs each); compiled, the same walk is a few µs.

Hash of the n tokens t_0 .. t_(n-1) ending at a position, salted by the writer's scope:
    (sum over j of (t_j + 2) * BASE ** (n - 1 - j)  mod 2 ** 64)  XOR  salt(scope)
A window that holds a separator (a negative token) is never hashed.

numba is chosen over a C extension: it installs as a wheel (no compiler at install or first start), and the
loops stay Python that a reader can run uncompiled (NUMBA_DISABLE_JIT=1). The machine code is cached
(speculators/jit.py); suffix_index.warm() compiles or loads it at start-up, not in the first request's step.
"""
from __future__ import annotations

import numpy as np

from specserve.speculators.jit import compiled

LEVELS = (32, 16, 8, 4, 2)      # n-gram lengths indexed, longest first
MAX_MATCH = 64                 # longest match length measured (caps the draft-length rule)
MAX_CHAIN = 32                 # chain entries examined per level and lookup (bounds the work)
SEPARATOR = -1
_M64 = (1 << 64) - 1
_BASE = 0x100000001B3
_MIX = 0x9E3779B97F4A7C15
_LEVELS = np.asarray(LEVELS, dtype=np.int64)                                   # [levels]
# _POWERS[li, j] = BASE ** (n - 1 - j) mod 2 ** 64 for the level's n, j < n        [levels, LEVELS[0]]
_POWERS = np.zeros((len(LEVELS), LEVELS[0]), dtype=np.uint64)
for _li, _n in enumerate(LEVELS):
    _POWERS[_li, :_n] = [pow(_BASE, _n - 1 - j, 1 << 64) for j in range(_n)]


def salt(scope: int) -> np.uint64:
    """The XOR that keeps one scope's windows in other buckets than another's (most of the time: a bucket
    can still be shared, so every candidate's scope is checked too)."""
    return np.uint64((scope * _MIX) & _M64)


def hash_window(window, n: int, scope: int) -> int:
    """The hash of one window of n tokens, in Python ints: the reference the compiled hash is tested against."""
    h = sum((t + 2) * pow(_BASE, n - 1 - j, 1 << 64) for j, t in enumerate(window)) & _M64
    return h ^ int(salt(scope))


@compiled
def _window_hash(tokens, cap, last, li, n, salted):
    """(hash, True) of the n ring tokens ending at absolute position `last`; (0, False) across a separator."""
    h = np.uint64(0)
    first = last - n + 1
    for j in range(n):
        t = tokens[(first + j) % cap]
        if t < 0:
            return np.uint64(0), False
        h += np.uint64(t + 2) * _POWERS[li, j]
    return h ^ salted, True


@compiled
def append(tokens, scope, head, prev, mask, start, new, scope_id, salted):
    """Write `new` at absolute positions start .. start + len(new) - 1 of the ring and push every window they
    end (fully held, no separator) onto its level's chain. Returns the new end. len(new) <= capacity."""
    cap = tokens.shape[0]
    end = start + new.shape[0]
    for i in range(new.shape[0]):
        tokens[(start + i) % cap] = new[i]
        scope[(start + i) % cap] = scope_id
    oldest = max(0, end - cap)
    for p in range(start, end):
        for li in range(_LEVELS.shape[0]):
            n = _LEVELS[li]
            if p - n + 1 < oldest:
                continue
            h, ok = _window_hash(tokens, cap, p, li, n, salted)
            if ok:
                b = np.int64(h & mask)
                prev[li, p % cap] = head[li, b]
                head[li, b] = p
    return end


@compiled
def match(tokens, scope, head, prev, mask, oldest, limit, tail, scope_id, salted, enough, ends):
    """The candidates of the longest indexed level whose n tokens equal tail's last n, written by scope_id,
    with a token after them before `limit`: written to ends[:count], newest first. Returns (count, length):
    length is the longest match among them, measured up to min(len(tail), MAX_MATCH, enough) (a level at
    least `enough` long is not re-measured); (0, 0) when no level matches."""
    cap = tokens.shape[0]
    size = tail.shape[0]
    for li in range(_LEVELS.shape[0]):
        n = _LEVELS[li]
        if size < n:
            continue
        h = np.uint64(0)
        for j in range(n):
            h += np.uint64(tail[size - n + j] + 2) * _POWERS[li, j]
        p = head[li, np.int64((h ^ salted) & mask)]
        count = 0
        walked = 0
        while p >= oldest + n - 1 and walked < MAX_CHAIN:
            e = p
            p = prev[li, e % cap]
            walked += 1
            if e + 1 >= limit or scope[e % cap] != scope_id:
                continue
            same = True
            for j in range(n):
                if tokens[(e - n + 1 + j) % cap] != tail[size - n + j]:
                    same = False
                    break
            if same:
                ends[count] = e
                count += 1
        if count == 0:
            continue
        length = n
        if n < enough:
            m = min(size, MAX_MATCH, enough)
            for c in range(count):
                e = ends[c]
                got = n
                while got < m and e - got >= oldest and tokens[(e - got) % cap] == tail[size - 1 - got]:
                    got += 1
                length = max(length, got)
        return count, length
    return 0, 0


@compiled
def follow(tokens, ends, count, limit, max_len, min_prob, out):
    """Follow the candidates ends[:count]: at each position the token most of the still-agreeing ones continue
    with (ties: the newest), stopping at max_len, where none continues (a separator or `limit`), or where the
    path's probability (product of those frequencies) falls below min_prob. The draft goes to out[:n].
    Returns (n, expected accepted tokens under the frequencies)."""
    cap = tokens.shape[0]
    alive = np.ones(count, dtype=np.bool_)
    agreeing = count
    prob = 1.0
    expected = 0.0
    n = 0
    for j in range(max_len):
        best, top = -1, 0
        for i in range(count):
            pos = ends[i] + 1 + j
            if not alive[i] or pos >= limit or tokens[pos % cap] < 0:
                continue
            t = tokens[pos % cap]
            votes = 0
            for i2 in range(count):
                pos2 = ends[i2] + 1 + j
                if alive[i2] and pos2 < limit and tokens[pos2 % cap] == t:
                    votes += 1
            if votes > top:
                best, top = t, votes
        if top == 0:
            break
        prob *= top / agreeing
        if prob < min_prob:
            break
        out[n] = best
        n += 1
        expected += prob
        agreeing = 0
        for i in range(count):
            pos = ends[i] + 1 + j
            if alive[i] and pos < limit and tokens[pos % cap] == best:
                agreeing += 1
            else:
                alive[i] = False
    return n, expected


@compiled
def draft(tokens, scope, head, prev, mask, oldest, limit, tail, scope_id, salted, k, factor, min_prob, ends, out):
    """match, then follow for up to min(k, max(1, int(factor x match length))) tokens: (n, expected), the
    draft in out[:n]; (0, 0.0) without a match."""
    enough = int(np.ceil(k / factor))          # a match this long already drafts k: measured no further
    count, length = match(tokens, scope, head, prev, mask, oldest, limit, tail, scope_id, salted, enough, ends)
    if count == 0:
        return 0, 0.0
    cap = min(k, max(1, int(factor * length)))
    return follow(tokens, ends, count, limit, cap, min_prob, out)
