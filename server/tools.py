"""Tool calling: what the chat template renders, what a forced tool_choice constrains, and how
tool calls are parsed out of the model's text."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .errors import BadRequest
from .protocol import ChatCompletionRequest, NamedToolChoice

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text

    def to_openai(self) -> dict:
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request asks of tools: templates to render, whether to parse, what to force."""

    tools: list[dict] | None  # OpenAI tool definitions, as the chat template receives them
    parse: bool  # look for tool calls in the output
    forced_schema: dict | None  # a JSON schema the whole output must follow (named or required choice)

    @property
    def names(self) -> set[str]:
        return {tool["function"]["name"] for tool in self.tools or []}


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice = body.tool_choice
    if choice is not None and not tools:
        raise BadRequest("tool_choice needs tools", "tool_choice")
    if not tools or choice == "none":
        return ToolPlan(tools or None, False, None)
    names = {tool["function"]["name"]: tool["function"] for tool in tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        if name not in names:
            raise BadRequest(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan(tools, True, _call_schema([names[name]]))
    if choice == "required":
        return ToolPlan(tools, True, _call_schema(list(names.values())))
    return ToolPlan(tools, True, None)


def _call_schema(functions: list[dict]) -> dict:
    """One call of any of ``functions``: {"name": <its name>, "arguments": <its parameters>}."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                "arguments": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for function in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def parse_tool_calls(text: str, known: set[str]) -> tuple[str | None, list[ToolCall]]:
    """Split model text into (content, tool calls). Recognises Hermes/Qwen ``<tool_call>{...}</tool_call>``
    blocks and a bare JSON call {"name": ..., "arguments"|"parameters": {...}} (Llama 3.1 style)."""
    calls: list[ToolCall] = []
    candidates = TOOL_CALL_BLOCK.findall(text) if "<tool_call>" in text else [text.strip()]
    for candidate in candidates:
        call = _as_call(candidate, known)
        if call is None:
            return text, []  # not a well-formed call: leave the text as it is
        calls.append(call)
    if not calls:
        return text, []
    content = TOOL_CALL_BLOCK.sub("", text).strip() if "<tool_call>" in text else ""
    return content or None, calls


def _as_call(candidate: str, known: set[str]) -> ToolCall | None:
    try:
        value = json.loads(candidate)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in known:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments))


MARKER = "<tool_call>"


class ToolCallStream:
    """Streams plain content at once, but holds back text that may be a tool call until the end."""

    def __init__(self, known: set[str]) -> None:
        self.known = known
        self.sent = ""  # content already released
        self.held = ""  # text that may hold a tool call
        self.holding = False

    def push(self, text: str) -> str:
        self.held += text
        if not self.holding:
            start = self.held.find(MARKER)
            stripped = (self.sent + self.held).lstrip()
            if start < 0 and not self.sent.strip() and stripped.startswith("{"):
                start = 0  # a bare JSON call at the start of the output
            if start >= 0:
                self.holding = True
                return self._release(start)
            if not stripped:
                return ""
            return self._release(len(self.held) - _partial_marker(self.held))
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The last content to send, and the tool calls found in what was held."""
        content, calls = parse_tool_calls(self.held, self.known) if self.holding else (self.held, [])
        self.held = ""
        return content or "", calls

    def _release(self, upto: int) -> str:
        out, self.held = self.held[:upto], self.held[upto:]
        self.sent += out
        return out


def _partial_marker(text: str) -> int:
    """Length of the longest suffix of ``text`` that begins the marker."""
    for size in range(min(len(MARKER) - 1, len(text)), 0, -1):
        if MARKER.startswith(text[-size:]):
            return size
    return 0
