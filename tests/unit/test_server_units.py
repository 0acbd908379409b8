"""Server pieces without a server: --chat-template resolution, chat rendering, error shapes, request models."""
from __future__ import annotations

import pytest

from onecard.config import ConfigError
from onecard.frontend.tokenizer import (
    ChatTemplateError,
    load_tokenizer,
    prepare_messages,
    render_chat,
    resolve_chat_template,
)
from onecard.server.errors import error_body, to_api_error
from onecard.server.openai_types import ChatCompletionRequest, CompletionRequest


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def test_chat_template_file_or_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert resolve_chat_template(str(f)) == "{{ messages[0].content }}"
    assert resolve_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    assert resolve_chat_template(None) is None
    with pytest.raises(ConfigError, match="--chat-template=missing.jinja"):
        resolve_chat_template("missing.jinja")


def test_render_matches_transformers(tok):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    ours = render_chat(tok, msgs, chat_template_kwargs={"enable_thinking": False})
    ref = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                                  tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert ours == ref
    custom = render_chat(tok, msgs, chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert custom == "[s][hi]"


def test_continue_final_message(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, here"}]
    text = render_chat(tok, msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("Sure, here")
    with pytest.raises(ChatTemplateError):
        render_chat(tok, msgs, add_generation_prompt=True, continue_final_message=True)


def test_tool_call_arguments_become_dicts_for_templates():
    out = prepare_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


def test_image_parts_are_refused(tok):
    with pytest.raises(ChatTemplateError, match="image_url"):
        render_chat(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_error_shapes():
    assert error_body("m", 404, "model") == {"error": {"message": "m", "type": "NotFoundError", "param": "model",
                                                       "code": 404}}
    e = to_api_error(RuntimeError("secret internals"))
    assert e.status == 500 and "secret" not in e.message
    assert to_api_error(ValueError("bad top_p")).status == 400


def test_sampling_params_from_requests():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=7,
                                max_tokens=3, logprobs=True, top_logprobs=2, top_k=5, stop="END", seed=1)
    sp = req.to_sampling_params({"temperature": 0.7, "top_k": 20})
    assert (sp.max_tokens, sp.logprobs, sp.top_k, sp.temperature, sp.stop, sp.seed) == (7, 2, 5, 0.7, ["END"], 1)
    assert req.tool_choice == "none"
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 tools=[{"type": "function", "function": {"name": "f"}}]).tool_choice == "auto"
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt="a").to_sampling_params({}).max_tokens == 16
    with pytest.raises(ValueError, match="guided_decoding_backend"):     # (response_format: test_structured)
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                              guided_decoding_backend="outlines").to_sampling_params({})
