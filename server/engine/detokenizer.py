"""Incremental detokenization with stop strings matched across token boundaries.

Byte-level BPE tokens can end inside a UTF-8 character, so text is only committed once the decoded
window no longer ends in U+FFFD. Two offsets bound the window (the prefix/read-offset scheme):
tokens[prefix_offset:read_offset] were decoded last time; tokens[prefix_offset:] is decoded now, and
the difference is the new text.

When the request finishes, tokens still waiting for the rest of a character are flushed as U+FFFD,
so the final text always equals decoding every output token at once (what `tokenizer.decode` gives).

Stop strings are searched in the committed text, starting far enough back to catch a match that
straddles the previous piece. While streaming, a text tail that could still grow into a stop string
is held back, so a stop string is never emitted, not even in part.

Example: stop=["\\n\\n"], pieces "x = 1", "\\n", "\\ny" -> deltas "x = 1", "" (held "\\n"), then the match
cuts the text to "x = 1" and the request finishes with stop_reason "\\n\\n".
"""
from __future__ import annotations

from specserve.server.engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], include_stop_str: bool = False) -> None:
        self.tok = tokenizer
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.sent = 0          # chars of `text` already handed out

    def append(self, token_id: int, may_stop: bool = True) -> str | None:
        """Add one token; return the stop string it completed, if any (text is then cut).

        may_stop False (the request is still short of min_tokens): its text is not searched, so a stop
        string completed now neither ends the request nor cuts the text, later or ever (as in vLLM)."""
        self.tokens.append(token_id)
        prefix_text = self.tok.decode(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self.tok.decode(self.tokens[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        old_len = len(self.text)
        self.text += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if not self.stop or not may_stop:
            return None
        start = max(0, old_len - self.max_stop_len + 1)
        best = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[:idx + (len(s) if self.include_stop_str else 0)]
        return s

    def flush(self) -> None:
        """Commit tokens held back for an unfinished character (they decode to U+FFFD)."""
        if self.read_offset < len(self.tokens):
            prefix_text = self.tok.decode(self.tokens[self.prefix_offset:self.read_offset])
            new_text = self.tok.decode(self.tokens[self.prefix_offset:])
            self.text += new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset = len(self.tokens)

    def delta(self, finished: bool) -> str:
        if finished:
            self.flush()
        end = len(self.text)
        if not finished and self.stop:
            end -= self._held_back()
        end = max(end, self.sent)
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        text = self.text
        for n in range(min(self.max_stop_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
