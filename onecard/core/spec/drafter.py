"""The drafter interface the engine calls, and `make_drafter` from vLLM's `--speculative-config` keys.

Call protocol (one drafter serves every request of an engine; request ids are strings):
- `observe(req_id, tokens)`: optional, after each prefill chunk with the prompt tokens computed so far, so a
  long prompt is indexed while its prefill runs instead of in one decode step.
- `propose(req_id, tokens, max_k)`: `tokens` = prompt + output so far (append-only between calls for one
  request); returns 0..max_k token ids that would follow `tokens[-1]` (also capped by the drafter's
  `num_speculative_tokens`).
- `finish(req_id, tokens)`: the request ended (`tokens` = its final prompt + output), or was aborted or
  preempted without a resume (`tokens=None`: forget everything about it).

Cost contract of every drafter here: a call indexes exactly the tokens it has not seen before (amortized O(1)
each for ngram, O(max depth) each for suffix) and then answers in work bounded by the drafter's parameters
(n-gram sizes, tree depth, k), never by the length of the prompt. A request whose `tokens` are not an
extension of what the drafter saw last (the caller broke the append-only rule) is re-indexed from scratch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

# vLLM's SpeculativeConfig defaults (vllm/config/speculative.py): ngram uses 5..5 when neither bound is given
# and copies the given one when only one is; suffix decoding's four knobs.
NGRAM_DEFAULT_LOOKUP = 5
SUFFIX_DEFAULTS: dict[str, Any] = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}
# The `--speculative-config` keys each method's drafter reads (besides method and num_speculative_tokens);
# the engine passes these through and keeps the rest (model, max_model_len, ...) for itself.
DRAFTER_PARAMS: dict[str, tuple[str, ...]] = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": tuple(SUFFIX_DEFAULTS),
}


@runtime_checkable
class Drafter(Protocol):
    """What the engine calls; see the module docstring for the call protocol and the cost contract."""

    def propose(self, req_id: str, tokens: Sequence[int], max_k: int) -> list[int]: ...

    def observe(self, req_id: str, tokens: Sequence[int]) -> None: ...

    def finish(self, req_id: str, tokens: Sequence[int] | None) -> None: ...


def make_drafter(method: str, num_speculative_tokens: int | None = None, **params: Any) -> Drafter:
    """Build the drafter for `--speculative-config`'s `method` with its keys (vLLM names and defaults).

    Raises ValueError naming the key for an unknown method, an unknown key or a value out of range.
    """
    if method not in DRAFTER_PARAMS:
        raise ValueError(
            f"speculative method {method!r} has no drafter here; the drafter methods are "
            f"{sorted(DRAFTER_PARAMS)}"
        )
    unknown = sorted(set(params) - set(DRAFTER_PARAMS[method]))
    if unknown:
        raise ValueError(
            f"speculative config key(s) {unknown} do not apply to method {method!r}; "
            f"it reads num_speculative_tokens and {list(DRAFTER_PARAMS[method])}"
        )
    if method == "ngram":
        from onecard.core.spec.ngram import NgramDrafter

        if num_speculative_tokens is None:
            raise ValueError("method 'ngram' needs num_speculative_tokens (an integer >= 1)")
        lo, hi = params.get("prompt_lookup_min"), params.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = NGRAM_DEFAULT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        return NgramDrafter(num_speculative_tokens, prompt_lookup_min=lo, prompt_lookup_max=hi)

    from onecard.core.spec.suffix import SuffixDrafter

    cfg = {**SUFFIX_DEFAULTS, **params}
    depth = cfg["suffix_decoding_max_tree_depth"]
    # vLLM: suffix decoding chooses the draft length itself; num_speculative_tokens only caps it and
    # defaults to the tree depth.
    k = depth if num_speculative_tokens is None else num_speculative_tokens
    return SuffixDrafter(
        k,
        max_tree_depth=depth,
        max_cached_requests=cfg["suffix_decoding_max_cached_requests"],
        max_spec_factor=cfg["suffix_decoding_max_spec_factor"],
        min_token_prob=cfg["suffix_decoding_min_token_prob"],
    )

