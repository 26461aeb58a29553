"""Structured outputs at the HTTP edge: `response_format` (OpenAI) and `structured_outputs` (vLLM's names).

    response_format {"type": "text"}                                   free text
    response_format {"type": "json_object"}                            any JSON object
    response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": EBNF/Lark}
                       | {"json_object": true}                         exactly one of them

Both endpoints take both fields (one at a time). They become a StructuredSpec, compiled by
specserve/grammar before the request reaches the engine, so a bad schema, regex or grammar is a 400
that names it. The schema is enforced whether `strict` is true or not (a constraint is never loosened).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from specserve.sampling.params import StructuredSpec
from specserve.server.api.schema_base import OpenAIModel, Text

MAX_CHOICES = 1024


class JsonSchemaFormat(OpenAIModel):
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Text | None = Field(None, max_length=4096)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a `json_schema` object "
                             "with `name` and `schema`")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only allowed with type 'json_schema', not {self.type!r}")
        return self


class StructuredOutputs(OpenAIModel):
    """vLLM's structured-output extension; its other options are not offered, so they are refused."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: Text | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            names = [g.rstrip("_") for g in given]
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, "
                             f"json_object; got {names or 'none'}")
        return self

    def to_spec(self) -> StructuredSpec:
        if self.json_ is not None:
            return json_schema_spec(self.json_)
        if self.regex is not None:
            return StructuredSpec("regex", self.regex)
        if self.choice is not None:
            return StructuredSpec("choice", json.dumps(self.choice))
        if self.grammar is not None:
            return StructuredSpec("grammar", self.grammar)
        return StructuredSpec("json_object")


def json_schema_spec(schema: dict[str, Any] | str) -> StructuredSpec:
    return StructuredSpec("json", schema if isinstance(schema, str) else json.dumps(schema))


def request_spec(response_format: ResponseFormat | None,
                 structured_outputs: StructuredOutputs | None) -> tuple[StructuredSpec | None, str | None]:
    """(the request's constraint or None, the field it came from)."""
    fmt = response_format if response_format is not None and response_format.type != "text" else None
    if fmt is not None and structured_outputs is not None:
        raise ValueError("send either response_format or structured_outputs, not both")
    if structured_outputs is not None:
        return structured_outputs.to_spec(), "structured_outputs"
    if fmt is None:
        return None, None
    if fmt.type == "json_object":
        return StructuredSpec("json_object"), "response_format"
    assert fmt.json_schema is not None
    schema = fmt.json_schema.schema_
    return json_schema_spec(schema if schema is not None else {}), "response_format"
