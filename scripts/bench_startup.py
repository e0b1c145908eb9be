"""Start-up time: process start to the first generated token, cold and warm compilation cache.

Each start is a fresh Python process that does what `jaxserve serve` does before it listens
(load the model, build the engine with its warm-up compile of every bucket), then adds one
greedy request and steps until its first token. Times are from just before the process is
spawned (interpreter start and imports included):
- cold: JAX's persistent compilation cache is an empty directory;
- warm: the same directory, filled by the cold start.
The cache is the project's own (`models.model.enable_compilation_cache`, at
`$JAXSERVE_CACHE_DIR/xla_cache`): each start runs with JAXSERVE_CACHE_DIR set to a temporary
directory whose `models/` links to the real model directory, so the model is not fetched again.
Issue 14's target: warm start <= 10 s to serving.

    .venv/bin/python scripts/bench_startup.py                   # EngineConfig's defaults
    .venv/bin/python scripts/bench_startup.py --max-num-seqs 16 --max-model-len 2048
    .venv/bin/python scripts/bench_startup.py --quick --out /tmp/startup   # smoke run

The machine is shared: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent

MARKER = "BENCH_STARTUP_JSON "
TARGET_WARM_S = 10.0
PHASES = ("imports_s", "model_load_s", "engine_init_s", "warmup_s", "first_token_s")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default=None, help="default: EngineConfig's")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="default: EngineConfig's (--quick: 2)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: EngineConfig's (--quick: 64)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="default: EngineConfig's (--quick: 32)")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per start")
    ap.add_argument("--out", default=None,
                    help="write OUT.json and OUT.md (default docs/results/bench_startup; --quick "
                    "writes only when given)")
    ap.add_argument("--quick", action="store_true",
                    help="a few shape buckets (smaller batch and context): a smoke run")
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        for name, value in (("max_num_seqs", 2), ("max_model_len", 64),
                            ("max_num_batched_tokens", 32)):
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.out is None and not args.quick and args.child is None:
        args.out = str(REPO / "docs" / "results" / "bench_startup")
    if args.out is not None:
        args.out = str(pathlib.Path(args.out).with_suffix(""))
    return args


def engine_kwargs(args) -> dict:
    names = ("model", "dtype", "max_num_seqs", "max_model_len", "max_num_batched_tokens")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


# ---- the child: one start ------------------------------------------------------------------

def child(args) -> None:
    """Runs in the fresh process; `args.child` is the parent's time.time() before spawning."""
    t0 = args.child
    import jax
    from jaxserve import EngineConfig, LLMEngine, SamplingParams
    from jaxserve.runtime import backends
    from models import load_model
    marks = {"imports": time.time()}
    config = EngineConfig(**engine_kwargs(args))
    # What LLMEngine(config) does first, done here so that the load is timed on its own.
    model = load_model(config.model, backends.default_dtype(config.dtype),
                       weights_cache=config.weights_cache)
    marks["model_load"] = time.time()
    engine = LLMEngine(config, model=model)
    marks["engine_ready"] = time.time()
    engine.add_request("first", args.prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while not any(o.outputs and o.outputs[0].token_ids for o in engine.step()):
        if not engine.has_unfinished_requests():
            raise RuntimeError("the request finished without a token")
    marks["first_token"] = time.time()
    # Serving started before the structured-output variants were compiled (a thread of their
    # own): when they are, constrained requests are served too.
    engine.wait_until_warm()
    marks["all_programs"] = time.time()
    warmup = engine.warmup_seconds
    engine_s = marks["engine_ready"] - marks["model_load"]
    result = {
        "imports_s": marks["imports"] - t0,
        "model_load_s": marks["model_load"] - marks["imports"],
        "engine_init_s": engine_s - (warmup or 0.0),
        "warmup_s": warmup,
        "first_token_s": marks["first_token"] - marks["engine_ready"],
        "to_serving_s": marks["engine_ready"] - t0,
        "to_first_token_s": marks["first_token"] - t0,
        "to_all_programs_s": marks["all_programs"] - t0,
        "num_compiled": getattr(engine.runner, "num_compiled", None),
        "compiles_after_warmup": engine.stats().get("num_compiles_after_warmup"),
        "max_model_len": engine.max_model_len,
        "config": {k: v for k, v in dataclasses.asdict(config).items()
                   if v is None or isinstance(v, (int, float, str, bool))},
        "jax": jax.__version__, "backend": jax.default_backend(),
        "cache_dir": jax.config.jax_compilation_cache_dir,
    }
    print(MARKER + json.dumps(result), flush=True)


# ---- the parent: cold, then warm ----------------------------------------------------------

def start_once(args, cache_root: pathlib.Path) -> dict:
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--prompt", args.prompt]
    for name, value in engine_kwargs(args).items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    env = dict(os.environ, JAXSERVE_CACHE_DIR=str(cache_root))
    t0 = time.time()  # the child measures its phases from this moment
    proc = subprocess.run(cmd + ["--child", repr(t0)], capture_output=True, text=True, env=env,
                          timeout=args.timeout)
    wall = time.time() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"start-up run failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(MARKER):])
    cache = cache_root / "xla_cache"
    result["cache_files"] = sum(1 for p in cache.rglob("*") if p.is_file()) if cache.is_dir() else 0
    result["process_wall_s"] = wall  # to the child's exit
    return result


def temp_cache_root(model_dir: pathlib.Path) -> pathlib.Path:
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench_startup_"))
    (root / "models").symlink_to(model_dir, target_is_directory=True)
    return root


def table(runs: dict) -> str:
    lines = ["| start | to serving s | to first token s | all programs s | imports s | "
             "model load s | engine init s | warm-up s | first token s | programs | cache files |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in runs.items():
        cells = [f"{r[k]:.2f}" if isinstance(r.get(k), float) else str(r.get(k))
                 for k in ("to_serving_s", "to_first_token_s", "to_all_programs_s", *PHASES)]
        lines.append(f"| {name} | {' | '.join(cells)} | {r['num_compiled']} | "
                     f"{r['cache_files']} |")
    return "\n".join(lines)


def write_outputs(report: dict, prefix: str) -> list[pathlib.Path]:
    base = pathlib.Path(prefix)
    base.parent.mkdir(parents=True, exist_ok=True)
    js, md = base.with_suffix(".json"), base.with_suffix(".md")
    js.write_text(json.dumps(report, indent=2) + "\n")
    md.write_text(f"# Start-up time ({report['model']})\n\n{report['environment']}\n\n"
                  f"{table(report['runs'])}\n\nWarm start to serving: "
                  f"{report['runs']['warm']['to_serving_s']:.1f} s (target <= "
                  f"{TARGET_WARM_S:.0f} s).\n\nCommand: `{report['command']}`\n")
    return [js, md]


def model_dir(name: str) -> pathlib.Path:
    """The real models/ directory; a named model is fetched now, outside the timed starts."""
    from models import registry
    if name in registry.MODELS:
        registry.model_path(name)
    return registry.cache_dir() / "models"


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child is not None:
        child(args)
        return {}
    load_start = os.getloadavg()
    root = temp_cache_root(model_dir(args.model))
    try:
        runs = {}
        for name in ("cold", "warm"):
            runs[name] = start_once(args, root)
            r = runs[name]
            print(f"{name}: to serving {r['to_serving_s']:.2f} s, first token "
                  f"{r['to_first_token_s']:.2f} s (imports {r['imports_s']:.2f}, model load "
                  f"{r['model_load_s']:.2f}, engine init {r['engine_init_s']:.2f}, warm-up "
                  f"{r['warmup_s']:.2f} s for {r['num_compiled']} programs, first step "
                  f"{r['first_token_s']:.2f}); {r['cache_files']} files in the cache",
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_end = os.getloadavg()
    fmt = lambda load: "/".join(f"{x:.2f}" for x in load)  # noqa: E731
    env = (f"jax {runs['cold']['jax']} ({runs['cold']['backend']}), python "
           f"{platform.python_version()}, {os.cpu_count()} CPUs, load average at start "
           f"{fmt(load_start)}, at end {fmt(load_end)}; engine config "
           f"{runs['cold']['config']}, max_model_len {runs['cold']['max_model_len']}")
    report = {"model": args.model, "environment": env, "loadavg_start": load_start,
              "loadavg_end": load_end, "target_warm_to_serving_s": TARGET_WARM_S,
              "warm_meets_target": runs["warm"]["to_serving_s"] <= TARGET_WARM_S,
              "command": " ".join([pathlib.Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
              "runs": runs}
    print(env)
    print(table(runs))
    if runs["cold"]["cache_files"] == 0:
        print("warning: the cold start wrote nothing to the persistent compilation cache",
              file=sys.stderr)
    if args.out:
        for path in write_outputs(report, args.out):
            print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
