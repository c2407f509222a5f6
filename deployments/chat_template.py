"""Chat messages (with tools, tool calls and tool results) to prompt text, through the model's own template.

A template that mentions `tools` renders them itself, with assistant `tool_calls` and `tool` messages passed as
transformers expects them. Otherwise (SmolLM2's template, for one) the fallback writes the tool list and the
Hermes call format into the system message, earlier calls as `<tool_call>` blocks in the assistant's text and
tool results as `<tool_response>` blocks, which `deployments/tool_calls.py` reads back.
"""
from __future__ import annotations

import json
from typing import Any

from deployments.protocol import ChatMessage, Tool

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML \
tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_renders_tools(tokenizer: Any) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def render_chat(tokenizer: Any, messages: list[ChatMessage], tools: list[Tool] | None,
                add_generation_prompt: bool) -> str:
    """The prompt text; raises what the template raises for a conversation it refuses."""
    native = template_renders_tools(tokenizer)
    rendered = [_message(m, native) for m in messages]
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    if tool_dicts and not native:
        rendered = _with_tools_in_system(rendered, tool_dicts)
    kwargs = {"tools": tool_dicts} if tool_dicts and native else {}
    return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **kwargs)


def _message(m: ChatMessage, native: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.role == "assistant" and m.tool_calls:
        if native:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        else:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls]
            blocks = [f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in calls]
            out["content"] = "\n".join(([out["content"]] if out["content"] else []) + blocks)
    if m.role == "tool":
        if native:
            if m.tool_call_id is not None:
                out["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                out["name"] = m.name
        else:
            out["content"] = f"<tool_response>\n{out['content']}\n</tool_response>"
    return out


def _arguments(text: str) -> Any:
    """Templates index into arguments as an object; text that is not JSON stays text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _with_tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}".strip()}
        return [first] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages
