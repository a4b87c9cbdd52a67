"""Tools through the official OpenAI SDK against the live n-gram server (embedded SmolLM2, whose chat template
does not render tools: they reach it as a Hermes-style system prompt): a named or "required" tool_choice always
yields a call that parses against the tool's schema, streamed argument deltas concatenate to valid JSON, tool
results go back through the template, and bad tool requests get 400 envelopes."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id and call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_tool_choice_always_yields_that_call(oai, model_name, temperature):
    out = oai.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER, ADD], max_tokens=80,
                                      temperature=temperature, seed=3,
                                      tool_choice={"type": "function", "function": {"name": "add"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    check_call(choice.message.tool_calls[0], ADD)


def test_required_tool_choice_yields_a_valid_call(oai, model_name):
    out = oai.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER, ADD], max_tokens=80,
                                      temperature=0, tool_choice="required", parallel_tool_calls=False)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    check_call(calls[0], {"add": ADD, "get_weather": WEATHER}[calls[0].function.name])


def test_streamed_tool_call_arguments_concatenate_to_json(oai, model_name):
    chunks = list(oai.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER], max_tokens=80,
                                              temperature=0, tool_choice="required", stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].id and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    full = oai.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER], max_tokens=80,
                                       temperature=0, tool_choice="required")
    assert json.loads(full.choices[0].message.tool_calls[0].function.arguments) == json.loads(args)


def test_tool_result_goes_back_through_the_template(oai, model_name):
    first = oai.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER], max_tokens=80,
                                        temperature=0, tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    second = oai.chat.completions.create(model=model_name, messages=history, tools=[WEATHER], max_tokens=40,
                                         temperature=0, tool_choice="none")
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_tool_choice_none_is_plain_chat(oai, model_name):
    out = oai.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER], max_tokens=16,
                                      temperature=0, tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs,expect", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope'"),
    (dict(tool_choice="required"), "requires 'tools'"),
    (dict(tools=[]), "must not be empty"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]),
     "tools[0].function.parameters is not a valid JSON schema"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
])
def test_bad_tool_requests_get_a_400(oai, model_name, kwargs, expect):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model_name, messages=ASK, max_tokens=4, **kwargs)
    assert expect in e.value.message, e.value.body


def test_tool_call_parser_streams_at_any_split():
    """No server: the output split at every character gives the same content and calls as the whole text; a
    block that is not a call stays content."""
    from server.tool_calls import ToolCallStream, parse_tool_calls

    text = ('Let me check. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\nnot json\n</tool_call> done <tool_')
    content, calls = parse_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert content == "Let me check. <tool_call>\nnot json\n</tool_call> done <tool_"
    stream, pieces, streamed = ToolCallStream(), [], []
    for ch in text:
        piece, new = stream.feed(ch)
        pieces.append(piece)
        streamed += new
    pieces.append(stream.finish()[0])
    assert "".join(pieces).strip() == content and [c.arguments for c in streamed] == [c.arguments for c in calls]
