"""Sampling: logits -> processed probabilities -> tokens, and the speculative rejection sampler."""
