"""Sampling: logits -> processed probabilities -> tokens, and the speculative rejection sampler.

Nothing is imported here on purpose: specserve.sampling.params must stay importable without torch (the
scheduler and request bookkeeping import it). Import specserve.sampling.rejection.RejectionSampler directly.
"""
