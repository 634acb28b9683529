"""Decoding: the speculative decoder, its running batch, the step controller, and the pure rules they use
(acceptance, sampling, randomness, prompt lookup, stop strings, logprobs)."""
