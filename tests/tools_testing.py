"""Helpers of the tool-calling and structured-output tests: a replica that answers with a given
text in given pieces, a Hermes-style chat template that takes tools, and tools to offer."""

import asyncio

from app.engine.outputs import RequestOutput
from app.serving_types import ModelInfo
from tests.serve_testing import FakeReplicaHandle


class ScriptedLLMServer(FakeReplicaHandle):
    """An LLMServer handle whose replica answers every request with `text`, cut into `pieces` (a
    list of lengths, repeated; default 1 character a step), one output per piece, every choice the
    same; the last output is final, with `finish_reason`. `requests` holds what it was sent."""

    def __init__(self, text: str = "ok", pieces: list[int] | None = None, finish_reason: str = "stop",
                 max_model_len: int = 4096) -> None:
        super().__init__(ModelInfo("tiny-llama", max_model_len, 320, 16, "bf16", 1, 4096))
        self.text, self.pieces, self.finish_reason = text, pieces or [1], finish_reason
        self.requests = []

    def stream(self, request):
        self.requests.append(request)
        return self._outputs(request)

    def cancel(self) -> None:
        pass

    async def _outputs(self, request):
        cuts, start, k = [], 0, 0
        while start < len(self.text):
            cuts.append((start, min(len(self.text), start + self.pieces[k % len(self.pieces)])))
            start, k = cuts[-1][1], k + 1
        cuts = cuts or [(0, 0)]
        for n, (a, b) in enumerate(cuts):
            await asyncio.sleep(0)
            last = n == len(cuts) - 1
            for choice in range(request.sampling_params.n):
                # as a replica sends them: without the prompt (the ingress has it)
                yield RequestOutput(request.request_id, None, [], self.text[:b], self.text[a:b], [120],
                                    last, self.finish_reason if last else None, None, 0,
                                    token_ids=[120] * len(cuts) if last else None, index=choice)


# A Hermes / Qwen 2.5 style template that takes tools (its structure, trimmed).
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for tool_call in message.tool_calls or [] %}<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up in the glossary.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "enum": ["kv", "fp4", "router"]}},
                   "required": ["key"], "additionalProperties": False}}}
