"""Hybrid speculator: prompt lookup where the context repeats itself, a model-based drafter elsewhere.

Each step and each request, the n-gram lookup runs first (no model, microseconds). When the context's
suffix matches an earlier span of at least `prompt_lookup_min` tokens (default 2: a single shared token
is weak evidence), its continuation is the draft; otherwise the server's model-based drafter drafts
(EAGLE-3 if loaded, else MTP, else the draft model). Code edits, quoted text and loops get the long,
nearly free lookup drafts; fresh text gets the head's.

Why it stays exact: the choice depends only on the context, never on this step's target draw, and each
source's drafts come with their own draft distribution (n-gram: a point mass, draft_probs None; the
head: its probabilities), which is all the rejection sampler needs. The model drafter sees every step of
the request and never drafts from a stale state: a draft model observes them all; an EAGLE-3/MTP head
with a state stash (prefix caching on) rests through the steps the lookup drafted and catches up from
the stash, in one forward, the next time it drafts (speculators/hidden_drafter.py).

Worked example, k = 4, prompt_lookup_min 2: context "... a = f(x)\\n b = f(x)\\n a = f(" ends with
"= f(", which occurred before (n = 3 >= 2) -> lookup drafts "x)\\n b". A step later the context ends
with a fresh identifier no earlier span shares -> the head drafts 4 tokens.

Options (request `speculation` object): prompt_lookup_min (default 2), prompt_lookup_max (default 4).
"""
from __future__ import annotations

from collections.abc import Sequence

from specserve.speculators import registry
from specserve.speculators.base import BuildContext, DraftProposal, SpecRequest, Speculator, VerifiedStep
from specserve.speculators.ngram import NgramSpeculator

HYBRID_MIN = 2


class HybridSpeculator(Speculator):
    name = "hybrid"

    def __init__(self, fallback, fallback_name: str) -> None:
        self.lookup = NgramSpeculator(default_min=HYBRID_MIN)   # its own buffers (keyed by request id)
        self.fallback = fallback
        self.fallback_name = fallback_name
        self.drafted_by = {"ngram": 0, fallback_name: 0}          # requests-steps each source drafted
        self.source: dict[str, str] = {}       # request id -> the source of its drafts this step

    @classmethod
    def build(cls, ctx: BuildContext) -> HybridSpeculator | None:
        return cls.over(ctx.loaded)

    @classmethod
    def over(cls, speculators: dict) -> HybridSpeculator | None:
        """The hybrid over the first loaded model-based drafter (registry order), or None when none is."""
        name = next((m for m in registry.MODEL_DRAFTERS if m in speculators), None)
        return None if name is None else cls(speculators[name], name)

    @staticmethod
    def validate(options: dict) -> None:
        NgramSpeculator.validate(options)

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> DraftProposal:
        found = self.lookup.propose(requests, ks)
        token_ids, probs = list(found.token_ids), list(found.draft_probs)
        rest = [i for i, d in enumerate(token_ids) if not d]
        self.drafted_by["ngram"] += len(requests) - len(rest)
        for r, d in zip(requests, token_ids):
            self.source[r.request_id] = "ngram" if d else self.fallback_name
        if rest:
            drafted = self.fallback.propose([requests[i] for i in rest], [ks[i] for i in rest])
            for j, i in enumerate(rest):
                token_ids[i], probs[i] = drafted.token_ids[j], drafted.draft_probs[j]
                self.drafted_by[self.fallback_name] += bool(drafted.token_ids[j])
        return DraftProposal(token_ids, probs)

    def observe(self, step: VerifiedStep) -> None:
        self.fallback.observe(step)

    def drafter_of(self, request: SpecRequest) -> str | None:
        source = self.source.get(request.request_id)
        return source if source == self.fallback_name else None

    def release(self, request: SpecRequest) -> None:
        self.source.pop(request.request_id, None)
        self.lookup.release(request)
        self.fallback.release(request)

