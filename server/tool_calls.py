"""Tool calls in model output, in the Hermes/Qwen syntax (engine/grammar.py): `<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>`, into OpenAI `tool_calls`; whole texts (non-streaming) and text deltas
(streaming: content streams until a call opens; a call is sent once its block closes, its name first, then its
arguments), plus the system prompt that describes the tools to models whose chat template does not render them.

A block whose body is not a JSON object with a string "name" and object "arguments" stays in the content.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _parse_block(body: str) -> Optional[ParsedCall]:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments already as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[Optional[str], list[ParsedCall]]:
    """(content outside the calls or None when there is none, the calls) of a whole output."""
    parser = ToolCallStream()
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    content = (content + rest).strip()
    return content or None, calls + more


class ToolCallStream:
    """Feeds text deltas; returns what became content and which calls completed."""

    def __init__(self):
        self.buffer = ""
        self.in_call = False
        self.after_call = False  # the newline that ends a call block is part of it, whenever it arrives

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += delta
        content, calls = [], []
        while self.buffer:
            if self.after_call:
                self.buffer, self.after_call = self.buffer.removeprefix("\n"), False
                continue
            if self.in_call:
                end = self.buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(TOOL_CALL_CLOSE):]
                self.in_call = False
                call = _parse_block(body.strip())
                if call is not None:
                    calls.append(call)
                    self.after_call = True
                else:
                    content.append(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
                continue
            start = self.buffer.find(TOOL_CALL_OPEN)
            if start >= 0:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(TOOL_CALL_OPEN):]
                self.in_call = True
                continue
            keep = _partial_suffix(self.buffer, TOOL_CALL_OPEN)  # may be the start of a call: hold it back
            content.append(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end of the output: an unclosed call or a held-back prefix becomes content."""
        rest = (TOOL_CALL_OPEN if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        return rest, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def adapt_for_template(template: str, conversation: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]]
                       ) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """(messages, tools) for a chat template: unchanged when the template renders tools itself; otherwise the
    tools become a system prompt, assistant tool calls become <tool_call> blocks in the content and tool
    results become user turns in <tool_response> blocks (the Hermes convention)."""
    if "tools" in template and "tool_calls" in template:
        return conversation, tools
    out = []
    for m in conversation:
        m = dict(m)
        if m.get("tool_calls"):
            blocks = [f'{TOOL_CALL_OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}'
                      for c in m.pop("tool_calls")]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        out.append(m)
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """What a model whose template ignores `tools` is told about them (Hermes-style, the syntax we parse)."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You may call functions to help with the user's request. The functions are:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, answer with one block per call, and nothing else in the block:\n"
            f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{TOOL_CALL_CLOSE}')
