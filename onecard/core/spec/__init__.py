"""Speculative decoding (process B, pure Python): drafters, the draft-length policy and the engine's use of them.

Drafters: pure Python (numpy at most), no torch, no engine imports.

Contract (the engine codes against `drafter.Drafter`): a drafter is told each request's token ids
(prompt + output so far, append-only per request id) and proposes 0..max_k token ids that would follow
the last one. It never sees logits and never blocks: every call costs work bounded by the new tokens it
is shown (amortized O(1) each) plus a constant that does not grow with the prompt. `drafter.make_drafter`
maps vLLM's `--speculative-config` methods ("ngram", "suffix") and their keys to the classes in `ngram.py`
and `suffix.py`. `cost.py` (the MoE-aware cost of a verify step) and `policy.py` (how many draft tokens each
sequence verifies per step) decide how much of each proposal is worth verifying. `speculator.Speculator` is the
scheduler's side (drafts per step through the policy, metrics).
"""
