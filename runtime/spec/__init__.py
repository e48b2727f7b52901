"""Speculative decoding: proposers that guess the next tokens cheaply, and the lossless rule
that verifies a guess against the target model's distribution in one forward pass."""
