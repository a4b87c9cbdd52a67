"""Grammars for structured output as llguidance grammar strings: any JSON object, a JSON schema, tool calls.
No torch: the HTTP process builds and validates them before a request reaches the engine, which compiles the
string against the model's tokenizer (engine/structured.py).

Why llguidance (not xgrammar): it has no dependencies (xgrammar 0.2.9 requires torch, triton and
apache-tvm-ffi, which would put triton on the CPU install), its matchers roll back tokens (a rejected draft
path costs nothing to undo) and validate token lists, and it compiles JSON schema with $ref, anyOf, enums,
bounds and patterns lazily (no per-schema precompilation of the whole vocabulary).

JSON output is compact with ", " and ": " separators and no other whitespace: a model cannot loop on
whitespace, and the output parses with json.loads whatever it is.

Tool calls use the Hermes/Qwen syntax the Qwen3 chat templates ask for: `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`, one block per call.
"""
from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled; the message names the problem."""


def _checked(grammar: str, what: str) -> str:
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"{what}: {messages[0] if messages else 'invalid'}")
    return grammar


def json_schema_grammar(schema: Any, what: str = "invalid JSON schema") -> str:
    """A JSON value matching `schema` (a dict or a boolean schema)."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{what}: a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"{what}: {e}") from None
    return _checked(grammar, what)


def json_object_grammar() -> str:
    """Any JSON object (response_format {"type": "json_object"})."""
    return json_schema_grammar({"type": "object"})


def tool_call_schema(tools: list[dict]) -> dict:
    """The JSON schema of one call to any of `tools` (OpenAI function tools): {"name", "arguments"}."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_calls_grammar(tools: list[dict], parallel: bool = True) -> str:
    """One tool call block (or one or more when `parallel`) and nothing else: tool_choice "required" or named."""
    body = json.dumps({**tool_call_schema(tools), "x-guidance": JSON_OPTIONS})
    repeat = "+" if parallel else ""
    lark = (f'start: call{repeat}\n'
            f'call: "{TOOL_CALL_OPEN}\\n" obj "\\n{TOOL_CALL_CLOSE}" "\\n"?\n'
            f'obj: %json {body}\n')
    return _checked(LLMatcher.grammar_from_lark(lark), "invalid tool parameters schema")


def check_tool_schema(tool: dict, index: int) -> None:
    """A 400-worthy GrammarError when the tool's parameters are not a usable JSON schema."""
    params = tool["function"].get("parameters")
    if params is not None:
        json_schema_grammar(params, f"tools[{index}].function.parameters is not a valid JSON schema")
