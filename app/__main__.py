"""Command line: `python -m app generate "Once upon a time" [--model ...]`."""

from __future__ import annotations

import argparse
import logging
import sys

from app import LLM, SamplingParams
from app.engine.errors import InvalidRequestError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", default="tiny-llama", help="HF directory (Llama, Qwen2/2.5, Qwen3, Mistral), .gguf file, llama2.c .bin or dummy "
                     "model name")
    gen.add_argument("--tokenizer", default=None)
    gen.add_argument("--kv-cache-dtype", default="bf16")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        llm = LLM(model=args.model, tokenizer=args.tokenizer, kv_cache_dtype=args.kv_cache_dtype, device=args.device)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        outputs = llm.generate(args.prompts, params)
    except (InvalidRequestError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outputs):
        print(f"{prompt}{out.text}\n  [{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
