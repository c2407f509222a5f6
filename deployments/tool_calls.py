"""Tool calls: the grammar that forces them (`required`, a named function) and the parser that reads them back.

Formats read, streamed or whole:
- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the text, repeated;
- Llama 3 JSON: the answer is `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`), several
  separated by `;`, or a JSON array of them: the form `required` forces.
A call's id and name are sent as soon as the name is complete, then its arguments as raw JSON fragments.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from deployments.protocol import NamedToolChoice, Tool
from engine.sampling_params import StructuredOutput

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def forced_tool_output(tools: list[Tool], choice: str | NamedToolChoice,
                       parallel: bool) -> StructuredOutput | None:
    """The grammar that makes the answer a call: a named function's arguments, or (`required`) a JSON array of
    `{"name", "parameters"}` objects, one of each tool's shape (at most one call unless parallel)."""
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return StructuredOutput(json=json.dumps(tool.function.parameters or ANY_OBJECT))
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "parameters": t.function.parameters or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput(json=json.dumps(schema))


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # with the name, on a call's first delta
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ParserStep:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class NamedCallParser:
    """A named tool_choice: the whole answer is the function's arguments."""

    def __init__(self, name: str) -> None:
        self.calls = [ParsedToolCall(new_call_id(), name)]
        self._started = False

    def push(self, text: str) -> ParserStep:
        call = self.calls[0]
        call.arguments += text
        delta = ToolCallDelta(0, arguments=text)
        if not self._started:
            self._started = True
            delta.id, delta.name = call.id, call.name
        return ParserStep(calls=[delta] if text or delta.id else [])

    def finish(self) -> ParserStep:
        return self.push("") if not self._started else ParserStep()


class ToolCallParser:
    """Splits streamed text into content and tool calls (the formats above)."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.calls: list[ParsedToolCall] = []
        self._buffer = ""  # text not yet classified
        self._mode = "start"  # start | content | tagged | bare
        self._call: _CallScanner | None = None
        self._held_text = ""  # bare JSON read before it proved to be a call

    def push(self, text: str) -> ParserStep:
        self._buffer += text
        step = ParserStep()
        while self._advance(step):
            pass
        return step

    def finish(self) -> ParserStep:
        """The end of the answer: what was held back is content, or the rest of an unfinished call."""
        step = ParserStep()
        if self._mode == "bare" and not self.calls:  # bare JSON that never named a function: plain text
            step.content = self._held_text + self._buffer
        elif self._call is not None:
            self._end_call(step)
        elif self._mode in ("start", "content"):
            step.content = self._buffer
        self._buffer = self._held_text = ""
        self._call = None
        return step

    def _advance(self, step: ParserStep) -> bool:
        """Consumes what it can of the buffer; True if calling again may consume more."""
        if self._mode == "start":
            stripped = self._buffer.lstrip()
            if not stripped:
                return False
            if stripped.startswith(PYTHON_TAG) or stripped[0] in "{[":
                self._mode = "bare"
                self._held_text = ""
            elif PYTHON_TAG.startswith(stripped):
                return False
            else:
                self._mode = "content"
            return True
        if self._mode == "content":
            at = self._buffer.find(OPEN_TAG)
            if at < 0:
                keep = _partial_suffix(self._buffer, OPEN_TAG)
                step.content += self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return False
            step.content += self._buffer[:at]
            self._buffer = self._buffer[at + len(OPEN_TAG):]
            self._mode = "tagged"
            return True
        return self._advance_json(step)

    def _advance_json(self, step: ParserStep) -> bool:
        if self._call is None:
            skip = PYTHON_TAG if self._buffer.lstrip().startswith(PYTHON_TAG) else ""
            rest = self._buffer.lstrip()[len(skip):]
            if self._mode == "bare":
                rest = rest.lstrip("[,; \n\t\r]")
            elif rest.startswith(CLOSE_TAG):
                self._buffer = rest[len(CLOSE_TAG):]
                self._mode = "content"
                return True
            elif rest and CLOSE_TAG.startswith(rest):
                return False
            if self._mode == "bare" and not self.calls:
                self._held_text += self._buffer[:len(self._buffer) - len(rest)]
            self._buffer = rest
            if not rest:
                return False
            if rest[0] != "{":
                if self._mode == "bare" and not self.calls:  # not a call after all: plain content
                    self._mode = "content"
                    step.content += self._held_text
                    self._held_text = ""
                    return True
                self._buffer = rest[1:]  # stray text inside a tag: skipped
                return True
            self._call = _CallScanner()
        consumed, done = self._call.feed(self._buffer)
        if self._mode == "bare" and not self.calls:
            self._held_text += self._buffer[:consumed]
        self._buffer = self._buffer[consumed:]
        self._emit(step)
        if done:
            if self._call.name is None and self._mode == "bare" and not self.calls:
                self._call = None
                self._mode = "content"
                step.content += self._held_text
                self._held_text = ""
                return True
            self._end_call(step)
            return True
        return False

    def _emit(self, step: ParserStep, scanner: "_CallScanner | None" = None) -> None:
        scanner = scanner or self._call
        if scanner.name is None or (not self.parallel and len(self.calls) >= 1 and scanner.call is None):
            return
        if scanner.call is None:
            scanner.call = ParsedToolCall(new_call_id(), scanner.name)
            self.calls.append(scanner.call)
            step.calls.append(ToolCallDelta(len(self.calls) - 1, scanner.call.id, scanner.call.name))
        fragment = scanner.take_arguments()
        if fragment:
            scanner.call.arguments += fragment
            step.calls.append(ToolCallDelta(self.calls.index(scanner.call), arguments=fragment))

    def _end_call(self, step: ParserStep) -> None:
        scanner, self._call = self._call, None
        scanner.finish()
        self._emit(step, scanner)
        if scanner.call is not None and not scanner.call.arguments:
            scanner.call.arguments = "{}"
            step.calls.append(ToolCallDelta(self.calls.index(scanner.call), arguments="{}"))
        self._held_text = ""


class _CallScanner:
    """Reads one JSON object `{"name": "...", "arguments": VALUE}` character by character.

    The arguments' raw text is handed out as it arrives once the name is known (`take_arguments`); a string
    value of arguments (JSON inside a string) is decoded once it ends.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False
        self.key: str | None = None
        self.expect_key = True
        self.token_start = -1
        self.text = ""
        self.name: str | None = None
        self.call: ParsedToolCall | None = None
        self._args_start = self._args_sent = -1
        self._args_end = -1
        self._args_is_string = False

    def feed(self, chunk: str) -> tuple[int, bool]:
        """Characters of `chunk` consumed, and whether the object closed."""
        for i, ch in enumerate(chunk):
            pos = len(self.text)
            self.text += ch
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    self._string_closed(pos)
                continue
            if ch == '"':
                self.in_string = True
                if self.depth == 1:
                    self.token_start = pos
                    if not self.expect_key and self.key in ARGUMENT_KEYS and self._args_start < 0:
                        self._args_start, self._args_is_string = pos, True
                continue
            if ch in "{[":
                if self.depth == 1 and not self.expect_key and self.key in ARGUMENT_KEYS and self._args_start < 0:
                    self._args_start = pos
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1 and self._args_start >= 0 and self._args_end < 0 and self.key in ARGUMENT_KEYS:
                    self._args_end = pos + 1
                if self.depth == 0:
                    return i + 1, True
            elif self.depth == 1 and ch == ":":
                self.expect_key = False
            elif self.depth == 1 and ch == ",":
                self.expect_key = True
                self.key = None
            elif self.depth == 1 and not self.expect_key and not ch.isspace() and self.key in ARGUMENT_KEYS \
                    and self._args_start < 0:
                self._args_start = pos  # a number, true, false or null
        return len(chunk), False

    def _string_closed(self, pos: int) -> None:
        if self.depth != 1:
            return
        literal = self.text[self.token_start:pos + 1]
        if self.expect_key:
            self.key = json.loads(literal)
        elif self.key == "name" and self.name is None:
            self.name = json.loads(literal)
        elif self.key in ARGUMENT_KEYS and self._args_is_string and self._args_end < 0:
            self._args_end = pos + 1

    def take_arguments(self) -> str:
        """The arguments' text not handed out yet (all of it at once when they are a JSON string)."""
        if self._args_start < 0:
            return ""
        if self._args_is_string:
            if self._args_end < 0 or self._args_sent >= 0:
                return ""
            self._args_sent = self._args_end
            return json.loads(self.text[self._args_start:self._args_end])
        end = self._args_end if self._args_end >= 0 else len(self.text)
        start = max(self._args_start, self._args_sent)
        self._args_sent = end
        return self.text[start:end]

    def finish(self) -> None:
        if self._args_start >= 0 and self._args_end < 0 and not self._args_is_string:
            self._args_end = len(self.text)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that begins `tag` (held back: it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
