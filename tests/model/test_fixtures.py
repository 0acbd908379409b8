"""The shared tiny checkpoints are what they claim: HF loads them with no missing keys and the same weights,
experts are stored per expert, the tokenizer has Qwen3's special / added tokens and chat template."""
from __future__ import annotations

import json

import torch
from safetensors import safe_open


def test_moe_checkpoint_is_per_expert_and_hf_loads_it(tiny_moe_dir):
    from transformers import Qwen3MoeForCausalLM

    with safe_open(str(tiny_moe_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        gate = f.get_tensor("model.layers.1.mlp.experts.5.gate_proj.weight")
        up = f.get_tensor("model.layers.1.mlp.experts.5.up_proj.weight")
        down = f.get_tensor("model.layers.1.mlp.experts.5.down_proj.weight")
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in keys)
    assert gate.shape == (32, 64) and down.shape == (64, 32)
    model, info = Qwen3MoeForCausalLM.from_pretrained(str(tiny_moe_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    experts = model.model.layers[1].mlp.experts
    torch.testing.assert_close(experts.gate_up_proj[5], torch.cat([gate, up]), rtol=0, atol=0)
    torch.testing.assert_close(experts.down_proj[5], down, rtol=0, atol=0)
    cfg = json.loads((tiny_moe_dir / "config.json").read_text())
    assert cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2 and cfg["norm_topk_prob"] is True


def test_dense_checkpoint_loads_in_hf(tiny_dense_dir):
    from transformers import Qwen3ForCausalLM

    model, info = Qwen3ForCausalLM.from_pretrained(str(tiny_dense_dir), output_loading_info=True)
    assert not any(info.values())
    assert model.config.tie_word_embeddings is False
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tokenizer_tokens_and_template(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for t in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"):
        ids = tok.encode(f"x{t}y", add_special_tokens=False)
        assert tok.convert_tokens_to_ids(t) in ids, t
    # Qwen3 marks the think / tool-call tags as added but NOT special: decoding keeps them.
    ids = tok.encode("<think>a</think><tool_call>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>a</think><tool_call>"
    assert "<|im_end|>" not in tok.decode(tok.encode("a<|im_end|>"), skip_special_tokens=True)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"c": 1}}}]},
            {"role": "tool", "content": "sunny"}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert "<tools>\n{\"type\": \"function\"" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"c": 1}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gptq_fixture_config(tiny_moe_gptq_dir):
    cfg = json.loads((tiny_moe_gptq_dir / "config.json").read_text())
    qcfg = json.loads((tiny_moe_gptq_dir / "quantize_config.json").read_text())
    assert cfg["quantization_config"] == qcfg
    assert qcfg["bits"] == 4 and qcfg["group_size"] == 32 and qcfg["sym"] and not qcfg["desc_act"]
    assert qcfg["checkpoint_format"] == "gptq"
    with safe_open(str(tiny_moe_gptq_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.experts.3.down_proj.qweight").shape == (4, 64)
        assert f.get_tensor("model.layers.0.mlp.experts.3.down_proj.scales").dtype == torch.float16
        # sym v1: every stored zero nibble is 7 (true zero 8 minus one).
        assert (f.get_tensor("model.layers.0.self_attn.q_proj.qzeros") == 0x77777777).all()
        assert f.get_tensor("lm_head.weight").dtype == torch.float16
    assert "model.layers.0.mlp.gate.weight" in keys and "model.layers.0.mlp.gate.qweight" not in keys
    assert "lm_head.qweight" not in keys and "model.embed_tokens.weight" in keys
