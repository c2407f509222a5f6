"""The tool-call parser: Hermes tags and Llama 3 JSON, whole and streamed a few characters at a time."""
from __future__ import annotations

import json

import pytest

from deployments.tool_calls import NamedCallParser, ToolCallParser


def parse(text: str, chunk: int | None = None, parallel: bool = True):
    """Content, calls (name, arguments) and the streamed deltas, fed `chunk` characters at a time."""
    parser = ToolCallParser(parallel)
    pieces = [text] if chunk is None else [text[i:i + chunk] for i in range(0, len(text), chunk)]
    content, deltas = "", []
    for piece in pieces + [None]:
        step = parser.push(piece) if piece is not None else parser.finish()
        content += step.content
        deltas += step.calls
    return content, [(c.name, c.arguments) for c in parser.calls], deltas


def assemble(deltas):
    """What an OpenAI client builds from the deltas: id and name first, then argument fragments in order."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls and d.name
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
        calls[d.index]["arguments"] += d.arguments
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


HERMES = ('I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], '
          '"note": "a \\"}\\" brace"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'


@pytest.mark.parametrize("chunk", [None, 1, 3, 7])
@pytest.mark.parametrize("text, content, names", [
    (HERMES, "I will check.", ["get_weather", "get_time"]),
    (LLAMA, "", ["get_weather", "get_time"]),
    (REQUIRED, "", ["get_weather", "get_time"]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("Just text, with a < sign and <tool", "Just text, with a < sign and <tool", []),
])
def test_calls_and_content_are_the_same_streamed_or_whole(text, content, names, chunk):
    got_content, calls, deltas = parse(text, chunk)
    assert got_content.strip() == content
    assert [name for name, _ in calls] == names
    assert assemble(deltas) == calls
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)


def test_arguments_keep_their_raw_json():
    _, calls, _ = parse(HERMES, 2)
    assert json.loads(calls[0][1]) == {"city": "Paris", "days": [1, 2], "note": 'a "}" brace'}


def test_arguments_given_as_a_json_string_are_decoded():
    _, calls, _ = parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', 4)
    assert calls == [("f", '{"x": 1}')]


def test_without_parallel_calls_only_the_first_is_kept():
    _, calls, deltas = parse(REQUIRED, 5, parallel=False)
    assert [name for name, _ in calls] == ["get_weather"] and assemble(deltas) == calls


def test_named_call_streams_the_whole_answer_as_arguments():
    parser = NamedCallParser("get_weather")
    deltas = parser.push('{"ci') .calls + parser.push('ty": "Oslo"}').calls + parser.finish().calls
    assert deltas[0].id and deltas[0].name == "get_weather"
    assert assemble(deltas) == [("get_weather", '{"city": "Oslo"}')]
