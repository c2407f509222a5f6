"""An SSE event is one line to every reader, whatever text the model generated."""
from __future__ import annotations

import json

from deployments.openai_format import sse
from deployments.responses import CompletionChunk, CompletionChoice

# Every character Python's str.splitlines (and so httpx's aiter_lines) ends a line at, plus some ordinary text.
LINE_ENDS_FOR_SPLITLINES = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def test_generated_text_with_any_line_separator_stays_one_event_line():
    text = f"a{LINE_ENDS_FOR_SPLITLINES}b é 漢"
    chunk = CompletionChunk(id="cmpl-1", created=1, model="m",
                            choices=[CompletionChoice(index=0, text=text)])
    event = sse(chunk)
    lines = event.splitlines()
    assert lines == [lines[0], ""], lines
    assert lines[0].startswith("data: {")
    assert json.loads(lines[0][len("data: "):])["choices"][0]["text"] == text
