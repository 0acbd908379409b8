"""Every eager forward's attention metadata carries host copies of its lengths (AttentionMetadata's host_*), equal
to its device tensors: what the prefill attention below sm80 reads to choose SDPA's sequences with no device sync
(attention/sdpa.long_sequences). The real engine on the tiny GPTQ checkpoint, on the CPU; the attention op is
wrapped to look at its metadata and then run as is."""
from __future__ import annotations

from onecard import LLM, SamplingParams
from onecard.kernels import dispatch


def test_eager_steps_carry_host_lengths(tiny_moe_gptq_dir, monkeypatch):
    seen = []
    real = dispatch.paged_attention

    def look(q, k_cache, v_cache, md, *args):
        seen.append((md.host_query_start_loc.tolist(), md.host_seq_lens.tolist(), md.query_start_loc.tolist(),
                     md.seq_lens.tolist()))
        return real(q, k_cache, v_cache, md, *args)

    monkeypatch.setattr(dispatch, "paged_attention", look)
    llm = LLM(str(tiny_moe_gptq_dir), device="cpu", max_model_len=256)
    outs = llm.generate([list(range(3, 43)), list(range(5, 12))], SamplingParams(max_tokens=3, temperature=0))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert seen and all(hq == dq and hs == ds for hq, hs, dq, ds in seen)
    assert any(qsl[-1] >= 47 for qsl, _, _, _ in seen)                       # the prompts' step
    assert any(qsl == list(range(len(qsl))) for qsl, _, _, _ in seen)       # a decode step
