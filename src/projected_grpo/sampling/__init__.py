"""Tokens in, tokens and log-probs out: packing, seeded batched decoding, scoring forwards."""
