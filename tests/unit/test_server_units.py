"""Server pieces without a server: --chat-template resolution, chat rendering, error shapes, request models, the
server options (one table) as the settings and the request guard read them."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from onecard import cli
from onecard.config import ConfigError, EngineArgs, ServerConfig
from onecard.frontend.tokenizer import (
    ChatTemplateError,
    prepare_messages,
    render_chat,
    resolve_chat_template,
)
from onecard.server.errors import error_body, to_api_error
from onecard.server.openai_types import ChatCompletionRequest, CompletionRequest
from onecard.vocab import load_tokenizer

README = Path(__file__).resolve().parents[2] / "README.md"


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


def test_server_settings_take_the_server_options_from_the_table():
    """The server reads its options from ``ServerConfig`` as ``serve`` parsed them, not from a second
    declaration: ``ServerSettings`` declares none of them again, and what the flags say is what the request
    guard does (the key on /v1, the body limit as ``human_int`` reads it) and what the settings hold."""
    import asyncio

    import httpx

    from onecard.config import DEFAULT_MAX_REQUEST_BODY_BYTES
    from onecard.options import human_int, option_flags
    from onecard.server.app import ServerSettings
    from onecard.server.guard import RequestGuard
    from onecard.server.launch import settings_from

    assert not {f.name for f in fields(ServerSettings)} & set(option_flags(ServerConfig))
    config = EngineArgs(model="onecard/data/onecard-tiny-coder", device="cpu", max_model_len=128).create_config()
    ns = cli.build_serve_parser().parse_args(
        ["--api-key", "k", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
         "--max-request-body-bytes", "1k", "--disable-log-requests", "--disable-log-stats", "--api-threads", "3",
         "--structured-outputs-config", '{"disable_any_whitespace": true}'])
    given = ServerConfig.from_namespace(ns)
    settings = settings_from(config, given)
    o = settings.options
    assert (o.api_key, o.reasoning_parser, o.tool_call_parser, o.enable_auto_tool_choice) == \
        ("k", "qwen3", "hermes", True)
    assert (o.max_request_body_bytes, o.disable_log_requests, o.disable_log_stats, o.api_threads) == \
        (1000, True, True, 3)
    assert settings.structured_outputs.disable_any_whitespace is True
    assert settings.served_model_names == ["onecard/data/onecard-tiny-coder"] and settings.max_model_len == 128

    async def echo(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def statuses(options: ServerConfig) -> list[int]:
        transport = httpx.ASGITransport(app=RequestGuard(echo, options=options))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            key = {"Authorization": "Bearer k"}
            return [(await c.post("/v1/x", content=b"a")).status_code,
                    (await c.post("/v1/x", content=b"a" * 1000, headers=key)).status_code,
                    (await c.post("/v1/x", content=b"a" * 1001, headers=key)).status_code]

    assert asyncio.run(statuses(o)) == [401, 200, 413]
    # the defaults: no key, README's 8Mi body limit, overrides by field name, the caller's options untouched
    default = settings_from(config, api_key=None).options
    assert default.api_key is None and default.max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES
    assert DEFAULT_MAX_REQUEST_BODY_BYTES == human_int("8Mi") and "(default 8Mi)" in README.read_text()
    assert settings_from(config, given, api_key="other").options.api_key == "other" and given.api_key == "k"
    with pytest.raises(TypeError):
        settings_from(config, max_body_bytes=5)                # not an option's name
