"""How one chat choice's output becomes OpenAI's assistant message or stream deltas when tools are in play.

Forced calls (tool_choice required or named) are read from their grammar-constrained JSON; `auto` output
is read with the family's parser (server/api/tool_parsers.py). A choice that made calls ends with
finish_reason "tool_calls"; output cut by max_tokens before its calls are complete stays text ("length").

Streaming, OpenAI's shape: a call opens with a delta carrying its index, id, type and name (arguments
""), then arguments fragments under the same index. A named call streams its arguments as they are
generated; a required or auto choice's calls go out whole when the choice ends (they are only known
to be calls, and which, once they parse), with auto content before them streamed as it comes.
"""
from __future__ import annotations

from typing import Any

from specserve.server.api.responses import (
    ChatDelta,
    ChatResponseMessage,
    FunctionCall,
    FunctionCallDelta,
    ToolCallDelta,
    ToolCallOut,
)
from specserve.server.api.tool_parsers import StreamSplitter, ToolParser, get_parser
from specserve.server.api.tools import NamedToolChoice, ToolCall, forced_calls


def _out(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def _opening(index: int, call: ToolCall, arguments: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, id=call.id, type="function",
                         function=FunctionCallDelta(name=call.name, arguments=arguments))


class ToolCallFormat:
    """One request's tool handling: tool_choice and the family's parser."""

    def __init__(self, tool_choice: Any, parser_name: str, parallel: bool | None = None) -> None:
        self.tool_choice = tool_choice if tool_choice is not None else "auto"
        self.parser: ToolParser = get_parser(parser_name)
        self.parallel = parallel is not False     # parallel_tool_calls false: at most one call

    @property
    def forced(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output."""
        if self.forced:
            calls = forced_calls(self.tool_choice, text) if finish_reason == "stop" else None
            return (None, calls) if calls else (text, [])
        content, calls = self.parser.parse(text)
        return content, (calls if self.parallel else calls[:1])

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        content, calls = self.calls(text, finish_reason)
        if not calls:
            return ChatResponseMessage(content=text), finish_reason
        return ChatResponseMessage(content=content, tool_calls=_out(calls)), "tool_calls"

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """One streaming choice: text deltas in, chat deltas out."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.named = fmt.tool_choice.function.name if isinstance(fmt.tool_choice, NamedToolChoice) else None
        self.named_call = ToolCall(self.named, "") if self.named else None
        self.opened = False
        self.text = ""
        self.splitter = None if fmt.forced else StreamSplitter(fmt.parser)

    def feed(self, text: str) -> ChatDelta | None:
        self.text += text
        if self.named_call is not None:
            if not self.opened:
                self.opened = True
                return ChatDelta(tool_calls=[_opening(0, self.named_call, text)])
            return ChatDelta(tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))]) \
                if text else None
        if self.splitter is None:        # required: the array is held until it parses
            return None
        content = self.splitter.feed(text)
        return ChatDelta(content=content) if content else None

    def finish(self, finish_reason: str | None) -> tuple[list[ChatDelta], str | None]:
        """The deltas still to send and the choice's finish_reason."""
        if self.named_call is not None:
            complete = self.fmt.calls(self.text, finish_reason)[1]
            return [], ("tool_calls" if complete else finish_reason)
        if self.splitter is None:
            _, calls = self.fmt.calls(self.text, finish_reason)
            if not calls:
                return ([ChatDelta(content=self.text)] if self.text else []), finish_reason
            return [ChatDelta(tool_calls=[_opening(i, c, c.arguments)]) for i, c in enumerate(calls)], "tool_calls"
        rest, calls = self.splitter.finish()
        calls = calls if self.fmt.parallel else calls[:1]
        deltas = [ChatDelta(content=rest)] if rest else []
        deltas += [ChatDelta(tool_calls=[_opening(i, c, c.arguments)]) for i, c in enumerate(calls)]
        return deltas, ("tool_calls" if calls else finish_reason)
