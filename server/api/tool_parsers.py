"""Reading tool calls out of free model output (tool_choice auto), in the model family's own format.

    hermes       Hermes / Qwen:  text <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    llama3_json  Llama 3:        {"name": ..., "parameters": {...}}   (optionally after <|python_tag|>,
                                 several separated by ";")
    mistral      Mistral:        text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

`parse(text)` -> (content before the calls or None, calls). Output that does not parse as calls is
content: a model that merely mentions the marker is not turned into a call.

Streaming: `StreamSplitter` passes content through as it comes and holds back everything from the
first character that may begin a call (a marker, or for Llama 3 an opening brace at the start); the
calls go out in one delta each when the choice ends.

Worked example (hermes): 'Let me check.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
-> content 'Let me check.', calls [f('{"x": 1}')].
"""
from __future__ import annotations

import json
import re
from typing import Any

from specserve.server.api.tools import ToolCall


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):          # some models write the arguments as a JSON string already
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    name = ""
    start = ""           # the marker from which output may be a call

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def hold_from(self, pending: str, at_start: bool) -> tuple[int, bool]:
        """(index of `pending` from which to hold text back while streaming, whether a call has begun).
        at_start: nothing was sent yet. Text held without a call begun (a marker split across deltas)
        goes out with the next delta that rules the call out."""
        at = pending.find(self.start)
        if at >= 0:
            return at, True
        for n in range(min(len(self.start) - 1, len(pending)), 0, -1):
            if self.start.startswith(pending[-n:]):
                return len(pending) - n, False
        return len(pending), False


class HermesParser(ToolParser):
    name, start = "hermes", "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[at:]):
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        content = text[:at].strip()
        return (content or None), calls


class Llama3JsonParser(ToolParser):
    name, start = "llama3_json", "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.start):
            body = body[len(self.start):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls

    def hold_from(self, pending: str, at_start: bool) -> tuple[int, bool]:
        if not at_start:                 # calls are the whole output or nothing
            return len(pending), False
        stripped = pending.lstrip()
        if not stripped:
            return 0, False
        if stripped[0] == "{" or self.start.startswith(stripped[:len(self.start)]) \
                or stripped.startswith(self.start):
            return 0, True
        return len(pending), False


class MistralParser(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        try:
            value = json.loads(text[at + len(self.start):].strip())
        except ValueError:
            return text, []
        items = value if isinstance(value, list) else [value]
        calls = [_call(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return text, []
        content = text[:at].strip()
        return (content or None), calls      # type: ignore[return-value]  # None ruled out just above


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str) -> ToolParser:
    return PARSERS[name]()


class StreamSplitter:
    """Content deltas out as they come, anything that may be a call held back until the end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0            # characters of `text` already sent as content
        self.holding = False     # a call may have begun: everything from `sent` on waits for the end

    def feed(self, delta: str) -> str:
        """The content that can go out now."""
        self.text += delta
        if self.holding:
            return ""
        pending = self.text[self.sent:]
        hold, begun = self.parser.hold_from(pending, self.sent == 0)
        self.holding = begun
        self.sent += hold
        return pending[:hold]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to send, the calls) once the output is complete."""
        content, calls = self.parser.parse(self.text)
        rest = self.text[self.sent:]
        if not calls:
            return rest, []
        marker = self.text.find(self.parser.start, self.sent)
        before = self.text[self.sent:marker] if marker >= 0 else ""
        return before.rstrip(), calls
