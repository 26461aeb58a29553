"""How far behind each model drafter is on each `auto` request: the rows its next use must catch up.

A model drafter that `auto` did not choose for a request skips that request's steps (a head with a state
stash does not observe them, a draft model does not run); when chosen again it first reads what it
missed in one forward (speculators/hidden_drafter.py catch_up, speculators/draft_model.py). The goodput
policy prices that forward by its rows (spec_policy.GoodputPolicy.catch_up_s: c0 + c1 * rows, fitted
online) so `auto` switches a request to a drafter only when the switch pays.

Worked example: a request drafts with eagle3 at 120 tokens, then with suffix for 10 steps of 8 tokens.
At 200 tokens eagle3 is 80 rows behind; the step after it drafted again it is 0 behind (the verified
rows of a step a drafter drafted in are its regular observe, priced as its follow-up).
"""
from __future__ import annotations


class CatchUpLedger:
    def __init__(self) -> None:
        self.seen: dict[str, dict[str, int]] = {}    # request id -> method -> num_tokens when it last drafted
        self.runs: dict[str, list] = {}              # request id -> [model drafter, steps in a row it drafted]

    def behind(self, request, method: str, last: str | None) -> int:
        """Rows `method` must catch up before drafting for `request` (`last`: its method the step before)."""
        if method == last:
            return 0
        return request.num_tokens - self.seen.get(request.request_id, {}).get(method, 0)

    def drafted(self, request, method: str) -> None:
        self.seen.setdefault(request.request_id, {})[method] = request.num_tokens

    def step(self, request_id: str, drafter: str | None) -> tuple[str, int] | None:
        """Book which model drafter drafted for the request this step (None: a lookup or none); returns the
        run it ended, (drafter, steps in a row), if any: the steps one catch-up served."""
        run = self.runs.get(request_id)
        if run is not None and run[0] == drafter:
            run[1] += 1
            return None
        if drafter is None:
            self.runs.pop(request_id, None)
        else:
            self.runs[request_id] = [drafter, 1]
        return (run[0], run[1]) if run is not None else None

    def forget(self, request_id: str) -> tuple[str, int] | None:
        """The request left the engine (finished, aborted or preempted for good); returns its open run."""
        self.seen.pop(request_id, None)
        run = self.runs.pop(request_id, None)
        return (run[0], run[1]) if run is not None else None
