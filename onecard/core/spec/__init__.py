"""Speculative decoding (process B, pure Python): drafters, the draft-length policy and the engine's use of them."""
