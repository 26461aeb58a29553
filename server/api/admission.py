"""Admission control: a bound on the work that waits, so a flood cannot starve admitted requests.

"Waiting" here means an engine request that was admitted but has not produced its first output yet:
it is queued in the scheduler or in prefill. Both its count and its prompt tokens are bounded
(--max-waiting-requests, --max-waiting-tokens). An HTTP request is admitted whole or not at all
(all its n x prompts engine requests); beyond the bounds it gets 429 with `Retry-After`, which the
official clients honour when they retry. A request larger than the bounds on its own is admitted
when nothing else waits, so a legal request is never refused forever.

Everything here runs on the event loop thread: no locks. `release()` is idempotent, so the
first-output path and the cleanup path may both call it.
"""
from __future__ import annotations

from collections.abc import Sequence

from specserve.server.api.errors import APIError
from specserve.server.api.limits import Limits

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, limits: Limits) -> None:
        self.max_requests = limits.max_waiting_requests
        self.max_tokens = limits.max_waiting_tokens
        self._waiting: dict[str, int] = {}      # engine request id -> prompt tokens
        self.num_tokens = 0
        self.num_rejected = 0

    @property
    def num_requests(self) -> int:
        return len(self._waiting)

    def admit(self, request_ids: Sequence[str], prompt_lens: Sequence[int]) -> None:
        """Book these engine requests as waiting, or raise 429 if that would pass a bound."""
        tokens = sum(prompt_lens)
        over_requests = self.num_requests + len(request_ids) > self.max_requests
        over_tokens = self.num_tokens + tokens > self.max_tokens
        if self._waiting and (over_requests or over_tokens):
            self.num_rejected += 1
            what = (f"{self.num_requests} requests are waiting (limit {self.max_requests})" if over_requests
                    else f"{self.num_tokens} prompt tokens are waiting (limit {self.max_tokens})")
            raise APIError(429, f"The server is overloaded: {what}. Retry in a moment.",
                           code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        for rid, n in zip(request_ids, prompt_lens):
            self._waiting[rid] = n
            self.num_tokens += n

    def release(self, request_id: str) -> None:
        """The request produced its first output, finished or went away."""
        n = self._waiting.pop(request_id, None)
        if n is not None:
            self.num_tokens -= n
