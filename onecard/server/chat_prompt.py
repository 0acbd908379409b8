"""Conversation → prompt token ids and the output parsers: the one path chat completions, Responses and
Messages share.

Contract: ``await prepare_chat(state, messages, tools=..., tool_choice=..., ...)`` takes OpenAI chat messages
(tool-call arguments as JSON text or mappings) and OpenAI function tools, decides whether tool calls are
parsed (``"auto"`` needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``, as vLLM), builds the
output constraint (``frontend.constraints``: structured outputs, ``"required"`` / a named tool) and, given
``params``, compiles and attaches it (``state.grammar``), renders the chat template, encodes the
prompt on the text threads (off the event loop) and returns a ``PreparedChat``: ``prompt_ids`` and ``new_parser()``, a fresh ``ChoiceParser``
(reasoning + tool calls) per choice. Errors raise ``BadRequest`` with ``param`` set to ``param_prefix`` +
the field, so each API names its own fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onecard.frontend.constraints import constraint_for_request
from onecard.frontend.tokenizer import ChatTemplateError, encode_prompt, render_chat, surely_too_long
from onecard.parsers import prompt_opens_think
from onecard.sampling_params import SamplingParams
from onecard.server.chat_parsing import ChoiceParser
from onecard.server.errors import BadRequest

AUTO_TOOL_ERROR = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(slots=True)
class PreparedChat:
    prompt_text: str
    prompt_ids: list[int]
    tools: list[dict[str, Any]]
    parse_tools: bool
    tool_parser: str | None
    reasoning_parser: str | None      # None when thinking is off for this request
    opened_think: bool
    prefill: str
    parallel_tool_calls: bool

    def new_parser(self) -> ChoiceParser:
        return ChoiceParser(reasoning_parser=self.reasoning_parser, prompt_opened_think=self.opened_think,
                            tool_parser=self.tool_parser if self.parse_tools else None, tools=self.tools,
                            prefill=self.prefill, parallel_tool_calls=self.parallel_tool_calls)


def tool_mode(state, tools: list[dict] | None, tool_choice: Any, param: str = "tool_choice") -> tuple[bool, str | None]:
    """(parse tool calls?, parser name) for this request, or a 400 as vLLM answers."""
    s = state.settings
    if not tools or tool_choice == "none":
        return False, None
    if tool_choice == "auto":
        if not (s.options.enable_auto_tool_choice and s.options.tool_call_parser):
            raise BadRequest(AUTO_TOOL_ERROR, param=param)
        return True, s.options.tool_call_parser
    # required / named: enforced by the prefill; parse with the configured format (hermes by default)
    return True, s.options.tool_call_parser or "hermes"


async def prepare_chat(state, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                       tool_choice: Any = None, parallel_tool_calls: bool = True, add_generation_prompt: bool = True,
                       continue_final_message: bool = False, chat_template: str | None = None,
                       chat_template_kwargs: dict[str, Any] | None = None, add_special_tokens: bool = False,
                       param_prefix: str = "", refuse_too_long: bool = True, params: SamplingParams | None = None,
                       constraint_fields: dict[str, Any] | None = None,
                       response_format_param: str = "response_format") -> PreparedChat:
    """``tool_choice``: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}.
    Rendering and tokenizing run on the text threads (``state.run_blocking``), off the event loop; a text
    that is surely longer than the context is refused before tokenizing unless ``refuse_too_long`` is off."""
    s = state.settings
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    parse_tools, tool_parser = tool_mode(state, tools, tool_choice, param_prefix + "tool_choice")
    kwargs = dict(chat_template_kwargs or {})
    # the output constraint (structured outputs; tool_choice required / named): its fields are checked here
    # (a 400 naming the field before any work) and compiled below; the grammar makes the model write a
    # required call, so nothing is prefilled into the prompt
    constraint = None
    if params is not None:
        constraint = constraint_for_request(
            **(constraint_fields or {}), tools=tools if tool_choice != "none" else None, tool_choice=tool_choice,
            tool_format=(s.options.tool_call_parser or "hermes") if tools else None,
            parallel_tool_calls=parallel_tool_calls, response_format_param=response_format_param)
    prefill = ""

    def prompt() -> tuple[str, list[int]]:
        try:
            text = render_chat(
                state.tokenizer, messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template or s.chat_template,
                chat_template_kwargs=kwargs) + prefill
        except ChatTemplateError as e:
            raise BadRequest(str(e), param=param_prefix + "messages") from None
        least = surely_too_long(state.tokenizer, len(text), s.max_model_len) if refuse_too_long else None
        if least is not None:
            raise BadRequest(f"The prompt is at least {least} tokens long, longer than the maximum model length "
                             f"of {s.max_model_len}. Please reduce the length of the messages.",
                             param=param_prefix + "messages")
        return text, encode_prompt(state.tokenizer, text, add_special_tokens)

    prompt_text, prompt_ids = await state.run_blocking(prompt)
    thinking = s.options.reasoning_parser is not None and kwargs.get("enable_thinking", True) is not False
    if params is not None:
        await state.grammar.attach(params, constraint, thinking=thinking,
                                   prompt_opened_think=thinking and prompt_opens_think(prompt_text))
    return PreparedChat(
        prompt_text=prompt_text, prompt_ids=prompt_ids, tools=list(tools or []), parse_tools=parse_tools,
        tool_parser=tool_parser, reasoning_parser=s.options.reasoning_parser if thinking else None,
        opened_think=thinking and prompt_opens_think(prompt_text), prefill=prefill,
        parallel_tool_calls=parallel_tool_calls)
