"""OpenAI request schemas for /v1/completions and /v1/chat/completions, with declared bounds.

Every number carries a min and a max, every list a maximum length; the caps that an operator may
change (n, logprobs, stop strings, logit_bias size, prompt list length, messages) come from a
`Limits` value: `RequestModels.build(limits)` creates the concrete classes with those caps, so the
OpenAPI schema, the validation and the fuzzer all see the same bounds. Unknown fields are ignored as
OpenAI does; `speculation` and `prediction` are ours (prediction follows OpenAI's Predicted Outputs).

Defaults that the schemas cannot express (they depend on the prompt) are applied in params.py:
max_tokens omitted -> 16 for completions (OpenAI's default, clipped to the remaining context) and
the whole remaining context for chat (OpenAI's and vLLM's behaviour).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from specserve.server.api.limits import Limits
from specserve.server.api.schema_base import OpenAIModel, Text
from specserve.server.api.structured import ResponseFormat, StructuredOutputs
from specserve.server.api.tools import NamedToolChoice, Tool

INT32_MAX = 2**31 - 1
MAX_TOOLS = 128      # OpenAI's limit on functions per request
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class Speculation(OpenAIModel):
    """Ours: `{"method": "ngram", "num_speculative_tokens": 4, ...method options}`."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    method: Text = Field(min_length=1, max_length=32)
    num_speculative_tokens: int | None = Field(None, ge=0, le=64)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: Text


class Prediction(OpenAIModel):
    """OpenAI Predicted Outputs: text the completion is expected to largely repeat (the draft source)."""
    type: Literal["content"]
    content: Text | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingFields(OpenAIModel):
    """Fields shared by both endpoints. Capped fields are typed here and bounded in `_shared_caps`."""
    model: Text | None = Field(None, max_length=512)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[int, float] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    user: Text | None = Field(None, max_length=512)
    # extensions (vLLM names)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # ours
    speculation: Speculation | None = None
    prediction: Prediction | None = None
    # structured outputs (server/api/structured.py): OpenAI's response_format, vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    request_timeout: float | None = Field(
        None, gt=0, le=86400, description="seconds from arrival to the last token; past it every "
        "unfinished choice ends with finish_reason 'length' (the server's --request-timeout still applies)")

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None,
                                    info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    suffix: Text | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported by this server (no fill-in-the-middle)")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"best_of is not supported: omit it or set it equal to n ({n})")
        return value


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(OpenAIModel):
    type: Text = Field(max_length=64)
    text: Text | None = None


class ChatMessage(OpenAIModel):
    role: Role
    content: Text | list[ContentPart] | None = None
    name: Text | None = Field(None, max_length=256)
    tool_calls: list[dict[Text, Any]] | None = None
    tool_call_id: Text | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _content_rules(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content must not be null for a {self.role} message "
                             "(only an assistant message with tool_calls may omit it)")
        for part in self.content if isinstance(self.content, list) else ():
            if part.type != "text" or part.text is None:
                raise ValueError(f"only text content parts are supported, got type {part.type!r}")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        """The dict a chat template sees: text content, 'developer' read as 'system'."""
        if isinstance(self.content, list):
            content: str | None = "\n".join(part.text or "" for part in self.content)
        else:
            content = self.content
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content if content is not None else ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice_rules(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or ()]
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice other than 'none' needs `tools`")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools "
                             f"({names})")
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct function names")
        if self.uses_tools and (self.structured_outputs is not None or (
                self.response_format is not None and self.response_format.type != "text")):
            raise ValueError("tools cannot be combined with response_format or structured_outputs: "
                             "tool calls are constrained by the functions' own parameter schemas")
        return self

    @property
    def uses_tools(self) -> bool:
        """Whether tools are in play (tool_choice 'none', or no tools, answers in text)."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _shared_caps(lim: Limits) -> dict[str, Any]:
    stop_str = Annotated[Text, Field(min_length=1, max_length=lim.max_stop_len)]
    # JSON object keys are strings: logit_bias's token ids arrive as "1234", so the key alone is lax
    bias = Annotated[dict[Annotated[TokenId, Strict(False)], Annotated[float, Field(ge=-100.0, le=100.0)]],
                     Field(max_length=lim.max_logit_bias)]
    return {
        "n": (int, Field(1, ge=1, le=lim.max_n)),
        "stop": (stop_str | Annotated[list[stop_str], Field(max_length=lim.max_stop)] | None,
                 Field(None)),
        "stop_token_ids": (Annotated[list[TokenId], Field(max_length=lim.max_stop)] | None, Field(None)),
        "logit_bias": (bias | None, Field(None)),
    }


def _completion_caps(lim: Limits) -> dict[str, Any]:
    text = Annotated[Text, Field(min_length=1)]
    ids = Annotated[list[TokenId], Field(min_length=1, max_length=INT32_MAX)]
    batch = Field(min_length=1, max_length=lim.max_prompts)
    prompt = text | Annotated[list[text], batch] | ids | Annotated[list[ids], batch]
    return {
        **_shared_caps(lim),
        "prompt": (prompt, Field(...)),
        "logprobs": (int | None, Field(None, ge=0, le=lim.max_logprobs)),
        "best_of": (int | None, Field(None, ge=1, le=lim.max_n)),
    }


def _chat_caps(lim: Limits) -> dict[str, Any]:
    return {
        **_shared_caps(lim),
        "messages": (list[ChatMessage], Field(..., min_length=1, max_length=lim.max_messages)),
        "top_logprobs": (int | None, Field(None, ge=0, le=lim.max_logprobs)),
    }


@dataclass(frozen=True)
class RequestModels:
    """The concrete request classes for one server (one Limits value)."""
    completion: type[CompletionRequest]
    chat: type[ChatCompletionRequest]
    limits: Limits

    @classmethod
    def build(cls, limits: Limits) -> RequestModels:
        completion = create_model("CompletionRequest", __base__=CompletionRequest,
                                  __module__=__name__, **_completion_caps(limits))
        chat = create_model("ChatCompletionRequest", __base__=ChatCompletionRequest,
                            __module__=__name__, **_chat_caps(limits))
        return cls(completion=completion, chat=chat, limits=limits)
