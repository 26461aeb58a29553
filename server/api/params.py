"""Request -> SamplingParams / SpecParams, and the checks that need the model (vocab, context length).

max_tokens when omitted: 16 for /v1/completions (OpenAI's documented default), clipped to the
context left after the prompt; the whole remaining context for /v1/chat/completions (what OpenAI and
vLLM do). An explicit max_tokens that does not fit is a 400 with code `context_length_exceeded`.
"""
from __future__ import annotations

from typing import Any

from specserve.sampling.params import SamplingParams, StructuredSpec
from specserve.server.api.errors import bad_request
from specserve.server.api.protocol import ChatCompletionRequest, CompletionRequest
from specserve.speculators.base import SpecParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_INT64 = 2**64
_INT64_MIN = -(2**63)


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice i of a seeded request uses seed + i (wrapped into int64), so choices differ but repeat."""
    if seed is None:
        return None
    return (seed + index - _INT64_MIN) % _INT64 + _INT64_MIN


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       default: int | None, param: str) -> int:
    """The max_tokens to run with; 400 context_length_exceeded when the request cannot fit.

    Example: max_model_len 512, prompt 500 tokens: requested 12 -> 12; requested 13 -> 400;
    omitted with default 16 -> 12; omitted with default None (chat) -> 12.
    """
    remaining = max_model_len - prompt_len
    if requested is None:
        if remaining >= 1:
            return remaining if default is None else min(default, remaining)
        requested = 1
    if prompt_len + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {param}, {requested} for the "
            f"completion). Please reduce the length of the {param} or max_tokens.",
            param=param, code="context_length_exceeded")
    return requested


def check_token_ids(token_ids: list[int], vocab_size: int, param: str, allow_empty: bool = False) -> None:
    if not token_ids and not allow_empty:
        raise bad_request(f"{param} must not be empty", param=param)
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"{param} contains token id {token_id}, outside the vocabulary "
                              f"[0, {vocab_size})", param=param)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int,
                    logprobs: int | None, index: int, vocab_size: int,
                    structured: StructuredSpec | None = None) -> SamplingParams:
    """SamplingParams for choice `index` of the request (n is fanned out by the caller: n=1 here)."""
    params = SamplingParams(
        n=1,
        temperature=_or(req.temperature, 1.0),
        top_p=_or(req.top_p, 1.0),
        top_k=_or(req.top_k, 0),
        min_p=_or(req.min_p, 0.0),
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, 1.0),
        logit_bias=dict(req.logit_bias) if req.logit_bias else None,
        seed=choice_seed(req.seed, index),
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop_list,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured=structured,
    )
    check_token_ids(list(req.logit_bias or ()), vocab_size, "logit_bias", allow_empty=True)
    check_token_ids(list(req.stop_token_ids or ()), vocab_size, "stop_token_ids", allow_empty=True)
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        message = str(exc)
        first = message.split(" ", 1)[0].split("[", 1)[0]
        raise bad_request(message, param=first if first in type(req).model_fields else None) from None
    return params


def speculation(engine: Any, req: CompletionRequest | ChatCompletionRequest
                ) -> tuple[SpecParams, str | None]:
    """The request's speculation choice (or the server default) and a notice when it cannot be honoured.

    A `prediction` without a `speculation` field asks for the prediction speculator; when the server
    has none loaded the request is served without it and the response says so (OpenAI treats a
    prediction as a hint, so this is not an error).
    """
    asked = req.speculation.to_dict() if req.speculation is not None else None
    notice = None
    if asked is None and req.prediction is not None:
        if "prediction" in engine.speculators():
            asked = {"method": "prediction"}
        else:
            notice = "prediction ignored: this server has no prediction speculator loaded"
    if asked is not None and asked.get("method") == "prediction" and req.prediction is None:
        raise bad_request("speculation method 'prediction' needs a `prediction` field with the "
                          "expected text", param="speculation.method")
    try:
        spec = engine.resolve_speculation(asked)
    except ValueError as exc:
        raise bad_request(str(exc), param="speculation") from None
    if req.prediction is not None and notice is None and spec.method != "prediction":
        notice = f"prediction ignored: the request chose speculation method {spec.method!r}"
    return spec, notice


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value

