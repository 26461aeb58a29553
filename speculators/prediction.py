"""Predicted Outputs speculator: the request's predicted text (OpenAI `prediction`) is the draft source.

While the output follows the prediction, propose its next k tokens. After a divergence, re-align by
finding the output's suffix in the prediction (longest n-gram match) and continue from there; with no
match, propose nothing until one appears. Drafts are deterministic (draft_probs None).

Example: prediction "a = 1\\nb = 2\\nc = 3" and the model writes "a = 1\\nB = 2": after the "B" diverges,
the suffix " = 2" re-aligns the pointer after "b = 2" in the prediction and "\\nc = 3" is proposed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specserve.speculators.base import DraftProposal, SpecRequest, Speculator
from specserve.speculators.ngram_match import longest_match

REALIGN_MIN = 2         # tokens of output suffix needed to trust a re-alignment
REALIGN_MAX = 8


@dataclass
class _State:
    pred: np.ndarray        # [P] predicted token ids
    ptr: int = 0            # where the output continues in pred; -1 = lost
    seen: int = 0           # output tokens already accounted for


class PredictionSpeculator(Speculator):
    name = "prediction"

    def __init__(self) -> None:
        self._states: dict[str, _State] = {}

    @staticmethod
    def validate(options: dict) -> None:
        if options:
            raise ValueError(f"prediction speculation takes no options, got {sorted(options)}; "
                             "send the predicted text in the request's `prediction` field")

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        drafts = []
        for req, k in zip(requests, ks):
            st = self._state(req)
            self._advance(st, req.output_token_ids)
            drafts.append(st.pred[st.ptr:st.ptr + k].tolist() if st.ptr >= 0 else [])
        return DraftProposal(drafts, [None] * len(drafts))

    def _state(self, req) -> _State:
        st = self._states.get(req.request_id)
        if st is None:
            pred = np.asarray(req.prediction_token_ids or [], dtype=np.int64)
            st = self._states[req.request_id] = _State(pred)
        return st

    @staticmethod
    def _advance(st: _State, output: list[int]) -> None:
        if len(output) < st.seen:           # recomputed after a preemption: start over
            st.ptr, st.seen = 0, 0
        new = output[st.seen:]
        if not new:
            return
        if st.ptr >= 0 and st.pred[st.ptr:st.ptr + len(new)].tolist() == new:
            st.ptr += len(new)
        else:
            tail = np.asarray(output[-REALIGN_MAX:], dtype=np.int64)
            st.ptr = longest_match(st.pred, tail, REALIGN_MIN, REALIGN_MAX)
        st.seen = len(output)

    def release(self, request: SpecRequest) -> None:
        self._states.pop(request.request_id, None)
