"""`jaxserve` command line: download a model, generate text, serve an OpenAI-compatible API."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def _cmd_download(args) -> int:
    from models.registry import model_path
    print(model_path(args.model))
    return 0


def _engine_kwargs(args) -> dict:
    return dict(dtype=args.dtype, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                seed=args.seed if args.seed is not None else 0,
                enable_prefix_caching=not args.no_prefix_caching)


def _sampling_params(args):
    from jaxserve import SamplingParams
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos)


def _cmd_generate(args) -> int:
    from jaxserve import LLM
    try:
        params = _sampling_params(args)
        start = time.perf_counter()
        # A one-shot run compiles only the shapes it meets; a server compiles every bucket.
        llm = LLM(args.model, warmup=args.warmup, **_engine_kwargs(args))
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ready = time.perf_counter() - start
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                        use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        print(c.text)
        m = out.metrics
        print(f"[{len(out.prompt_token_ids)} prompt + {len(c.token_ids)} generated tokens, "
              f"finish={c.finish_reason}, ttft {m.time_to_first_token:.3f}s, "
              f"decode {len(c.token_ids) / max(m.decode_time, 1e-9):.1f} tok/s]", file=sys.stderr)
    warm = llm.engine.warmup_seconds
    compile_note = (f"incl. warm-up compile {warm:.1f}s" if warm is not None else
                    "no warm-up: the first steps include their compiles")
    print(f"[start-up {ready:.1f}s, {compile_note}; {llm.stats()}]", file=sys.stderr)
    return 0


def _cmd_serve(args) -> int:
    from jaxserve import EngineConfig, LLMEngine
    from jaxserve.server import ServerConfig, serve
    model = args.model_name or args.model
    try:
        config = ServerConfig(served_model_name=args.served_model_name or model,
                              api_key=args.api_key, threads=args.threads,
                              max_waiting_requests=args.max_waiting_requests)
        engine = LLMEngine(EngineConfig(model=model, **_engine_kwargs(args)))
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve(engine, args.host, args.port, config)


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    p.add_argument("model_name", nargs="?", metavar="MODEL", help="overrides --model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $JAXSERVE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for")
    p.add_argument("--threads", type=int, default=64, help="HTTP worker threads")
    p.add_argument("--max-waiting-requests", type=int, default=128,
                   help="requests queued beyond the running batch before 503")
    p.add_argument("--seed", type=int, default=None)
    _add_engine_args(p)
    p.set_defaults(func=_cmd_serve)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="model name, .gguf file, HF directory or orbax checkpoint")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16, help="KV block size (power of 2)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute shared prompt prefixes instead of reusing cached KV blocks")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("download", help="fetch a named model into the cache")
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.set_defaults(func=_cmd_download)
    p = sub.add_parser("generate", help="generate completions for one or more prompts")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--warmup", action="store_true",
                   help="compile every shape bucket first (what `serve` does); by default "
                        "only the shapes this run needs are compiled")
    _add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=_cmd_generate)
    _add_serve_parser(sub)
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
