"""Speculative decoding (process B, pure Python): drafters that propose tokens from a request's own text, and
the MoE-aware cost model and policy that decide how many of them each step verifies."""
