"""`jaxserve` command line: download a model, generate text."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _cmd_download(args) -> int:
    from models.registry import model_path
    print(model_path(args.model))
    return 0


def _cmd_generate(args) -> int:
    from models import load_model
    model = load_model(args.model, dtype=args.dtype)
    tok = model.tokenizer
    if tok is None:
        print(f"error: {args.model} has no tokenizer", file=sys.stderr)
        return 2
    text = (tok.apply_chat_template([{"role": "user", "content": args.prompt}])
            if args.chat else args.prompt)
    ids = ([tok.bos_token_id] if tok.add_bos and tok.bos_token_id is not None else []) + \
        tok.encode(text)
    start = time.perf_counter()
    out = model.greedy_generate(ids, args.max_tokens)
    elapsed = time.perf_counter() - start
    skip = [t for t in out if t not in tok.stop_token_ids]
    print(tok.decode(skip))
    print(f"[{len(ids)} prompt tokens, {len(out)} generated in {elapsed:.2f}s "
          "(greedy, dense recompute; includes compilation)]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("download", help="fetch a named model into the cache")
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.set_defaults(func=_cmd_download)
    p = sub.add_parser("generate", help="generate a completion (greedy)")
    p.add_argument("prompt")
    p.add_argument("--model", default="smollm2-135m",
                   help="model name, .gguf file, HF directory or orbax checkpoint")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.set_defaults(func=_cmd_generate)
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
