"""Tool calls in chat completions: the `tools` / `tool_choice` schemas and the forced-call grammar.

tool_choice  none      the model answers in text (tools are still shown to the chat template)
             auto      the model decides; calls are read from its own format (server/api/tool_parsers.py,
                       --tool-call-parser)
             required  at least one call, enforced: the output is a JSON array of {"name", "arguments"}
                       whose items are constrained to the functions' parameter schemas (one item when
                       parallel_tool_calls is false)
             named     that function, enforced: the output is its arguments object, under its schema

Worked example: tools [get_weather(city: string)], tool_choice "required" -> the grammar admits
`[{"name": "get_weather", "arguments": {"city": "Paris"}}]` and nothing that is not such a list.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from specserve.sampling.params import StructuredSpec
from specserve.server.api.schema_base import OpenAIModel, Text
from specserve.server.api.structured import json_schema_spec

FUNCTION_NAME = r"^[A-Za-z0-9_-]+$"
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class FunctionDef(OpenAIModel):
    name: Text = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME)
    description: Text | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDef

    def template_dict(self) -> dict[str, Any]:
        """What a chat template sees (the OpenAI shape, as HF templates expect it)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(OpenAIModel):
    name: Text = Field(min_length=1, max_length=64)


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: FunctionName


@dataclass
class ToolCall:
    """One call the model made: arguments as JSON text, as OpenAI returns them."""
    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parameters_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def forced_spec(tools: list[Tool], tool_choice: Any, parallel: bool | None) -> StructuredSpec | None:
    """The grammar that enforces `required` or a named function; None for none/auto."""
    if isinstance(tool_choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return json_schema_spec(parameters_schema(tool))
    if tool_choice != "required":
        return None
    item = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                        "arguments": parameters_schema(t)},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if parallel is False:
        schema["maxItems"] = 1
    return json_schema_spec(schema)


def forced_calls(tool_choice: Any, text: str) -> list[ToolCall] | None:
    """The calls in a forced (required / named) output; None when the output is incomplete (cut by
    max_tokens, so it is returned as text with finish_reason 'length')."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(tool_choice, NamedToolChoice):
        return [ToolCall(tool_choice.function.name, json.dumps(value, ensure_ascii=False))]
    return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]
