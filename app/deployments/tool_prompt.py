"""The chat template's inputs for a request with tools: messages, and `tools=` or the fallback.

A template that takes tools (it references `tools`: Qwen 2.5 / Hermes, Llama 3.1, Mistral, ...)
gets them as Hugging Face's apply_chat_template passes them: `tools=[{"type": "function",
"function": {name, description, parameters}}]`, assistant messages with `tool_calls` (arguments
parsed) and `tool` messages with `tool_call_id`. It renders them in the format the model was
trained on.

A template without tools (SmolLM2's) gets the fallback, plain messages it can render:

- a system message (appended to the conversation's own first system message, if any) that lists
  the tools (name, description, JSON schema of the parameters, one JSON object a line inside
  <tools></tools>), gives the exact format of a call (the tool format's, hermes by default:
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`) and says what tool_choice asks;
- an assistant message's calls written out in that format after its content;
- tool results as a user message of `<tool_response>\\n...\\n</tool_response>` blocks (one
  message for consecutive results, in order).

The parser of the same format reads the calls back; tool_choice required / named and strict
tools are enforced by the grammar engine either way.

With tool_choice "none" the tools are not offered to the model (OpenAI: the model will not call
any); the history's calls and results are rendered all the same.
"""

from __future__ import annotations

import json

from app.deployments.protocol import ChatCompletionRequest, NamedToolChoice
from app.deployments.tool_formats import ToolFormat


def template_inputs(request: ChatCompletionRequest, fmt: ToolFormat,
                    template_takes_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template."""
    messages = request.template_messages()
    choice = request.effective_tool_choice
    offered = request.tools if request.tools and choice != "none" else None
    if template_takes_tools:
        return messages, [tool.template_dict() for tool in offered] if offered else None
    messages = plain_messages(messages, fmt)
    if offered:
        system = tools_system_prompt([tool.template_dict() for tool in offered], choice,
                                     request.parallel_tool_calls, fmt)
        if messages and messages[0]["role"] == "system":
            first = messages[0]
            messages[0] = {**first, "content": f"{first['content']}\n\n{system}" if first["content"] else system}
        else:
            messages.insert(0, {"role": "system", "content": system})
    return messages, None


def plain_messages(messages: list[dict], fmt: ToolFormat) -> list[dict]:
    """Tool calls and results as text in plain user / assistant messages."""
    out: list[dict] = []
    results_at = -1  # index in out of the user message that collects consecutive tool results
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if results_at == len(out) - 1 and results_at >= 0:
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
                results_at = len(out) - 1
            continue
        if m.get("tool_calls"):
            calls = fmt.render_calls([(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]])
            m = {"role": "assistant", "content": f"{m['content']}\n{calls}" if m["content"] else calls}
        else:
            m = {k: v for k, v in m.items() if k != "tool_call_id"}
        out.append(m)
    return out


def tools_system_prompt(tools: list[dict], choice, parallel_tool_calls: bool, fmt: ToolFormat) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    if isinstance(choice, NamedToolChoice):
        ask = f"You must call the function {choice.function.name} now."
    elif choice == "required":
        ask = "You must call at least one function now."
    else:
        ask = "Call a function only when it helps; otherwise answer in plain text."
    if not parallel_tool_calls:
        ask += " Call at most one function at a time."
    return (f"# Tools\n\nYou may call functions to help with the request. The functions, each with the JSON schema "
            f"of its parameters:\n<tools>\n{listed}\n</tools>\n\n{fmt.instructions()}\nThe results come back in a "
            f"user message, one <tool_response> block per call, in the order of the calls. {ask}")
