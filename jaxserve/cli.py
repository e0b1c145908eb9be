"""`jaxserve` command line: download a model, generate text, serve an OpenAI-compatible API,
benchmark, size a KV cache."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

from jaxserve.cli_lora import add_lora_modules_arg, check_lora_flags, load_lora_modules
from jaxserve.config import EngineConfig
from jaxserve.config_fields import add_config_args, config_kwargs
from jaxserve.distributed import ray_hosts
from models.config import DTYPES


def _cmd_download(args) -> int:
    from models.registry import model_path
    print(model_path(args.model))
    return 0


def _engine_kwargs(args) -> dict:
    """The EngineConfig fields the flags set (every field but those a command decides)."""
    return config_kwargs(args, EngineConfig)


def _start_profile(engine, args) -> None:
    """`--profile-dir` with `--profile-steps N`: capture the first N steps (else all of them)."""
    if args.profile_dir is not None and (args.profile_steps or not args.serve_like):
        engine.start_profile(num_steps=args.profile_steps)


def _stop_profile(engine) -> None:
    if engine.profiler.active:
        engine.stop_profile()
    for run in engine.profiler.captures:
        print(f"[profile: {run} (open the .xplane.pb in TensorBoard/xprof or "
              f"perfetto_trace.json.gz in ui.perfetto.dev)]", file=sys.stderr)


def _init_distributed(args) -> None:
    """Joins a multi-host run (before anything touches a device) when asked to."""
    given = [args.coordinator_address, args.num_processes, args.process_id]
    if all(v is None for v in given):
        return
    if any(v is None for v in given):
        raise ValueError("multi-host needs all of --coordinator-address, --num-processes and "
                         "--process-id")
    from jaxserve.runtime import multihost
    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)


def _reserve_host_cores(args) -> None:
    """--host-cores: the host loop's own CPUs, set before JAX's backend starts (its CPU pool is
    sized then; after _init_distributed, which must come first)."""
    if not args.host_cores:
        return
    from jaxserve.runtime.host_cores import reserve_host_cores
    try:
        cores = reserve_host_cores(args.host_cores)
    except RuntimeError as e:  # not Linux, or the backend already runs
        raise ValueError(str(e)) from e
    print(f"[{cores.describe()}]", file=sys.stderr)


def _follow(engine) -> bool:
    """On processes other than 0 of a multi-host run: run process 0's steps; True if so."""
    from jaxserve.runtime import multihost
    if engine.channel is None or multihost.is_leader():
        return False
    print(f"[followed {engine.channel.follow()} steps of process 0]", file=sys.stderr)
    return True


def _sampling_params(args):
    from jaxserve import SamplingParams
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos)


def _cmd_generate(args) -> int:
    try:
        # A one-shot run compiles only the shapes it meets; a server compiles every bucket.
        config = EngineConfig(warmup=args.warmup, **_engine_kwargs(args))
        params = _sampling_params(args)
        if args.distributed_executor_backend == "ray":
            return ray_hosts.main("generate", args, config)
        _init_distributed(args)
        _reserve_host_cores(args)
        from jaxserve import LLM
        start = time.perf_counter()
        llm = LLM(**dataclasses.asdict(config))
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if _follow(llm.engine):
        return 0
    try:
        return _generate(llm, args, params, time.perf_counter() - start)
    finally:
        if llm.engine.channel is not None:
            llm.engine.channel.stop()


def _generate(llm, args, params, ready: float) -> int:
    print_generated(generated(llm, args, params, ready))
    return 0


def generated(llm, args, params, ready: float) -> dict:
    """What `generate` prints, as plain data (a Ray-launched run returns it to the driver)."""
    _start_profile(llm.engine, args)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                        use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    _stop_profile(llm.engine)
    flat = {k: v for k, v in llm.stats().items() if not isinstance(v, dict)}  # not step/KV
    return {"outputs": [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
                         "num_prompt_tokens": len(o.prompt_token_ids),
                         "finish_reason": o.outputs[0].finish_reason,
                         "ttft": o.metrics.time_to_first_token,
                         "decode_time": o.metrics.decode_time} for o in outs],
            "ready": ready, "warmup_seconds": llm.engine.warmup_seconds, "stats": flat}


def print_generated(result: dict) -> None:
    for out in result["outputs"]:
        print(out["text"])
        n = len(out["token_ids"])
        print(f"[{out['num_prompt_tokens']} prompt + {n} generated tokens, "
              f"finish={out['finish_reason']}, ttft {out['ttft']:.3f}s, "
              f"decode {n / max(out['decode_time'], 1e-9):.1f} tok/s]", file=sys.stderr)
    warm = result["warmup_seconds"]
    compile_note = (f"incl. warm-up compile {warm:.1f}s" if warm is not None else
                    "no warm-up: the first steps include their compiles")
    print(f"[start-up {result['ready']:.1f}s, {compile_note}; {result['stats']}]",
          file=sys.stderr)


def run_on_host(command: str, args, config: dict, server: dict | None) -> dict:
    """One host process of a Ray-launched run, after multihost.initialize: the engine from
    plain config; process 0 runs `command`, the others follow it. Returns plain data."""
    from jaxserve import LLM
    from jaxserve.server import ServerConfig, serve
    _reserve_host_cores(args)
    start = time.perf_counter()
    llm = LLM(**config)
    if _follow(llm.engine):
        return {"followed": True}
    try:
        if command == "generate":
            ready = time.perf_counter() - start
            return {"generated": generated(llm, args, _sampling_params(args), ready)}
        _start_profile(llm.engine, args)
        return {"status": serve(llm.engine, args.host, args.port, ServerConfig(**server))}
    finally:
        if llm.engine.channel is not None:
            llm.engine.channel.stop()


def _admission(engine_config: EngineConfig) -> dict:
    """The server's admission bounds: the engine's, else the server's default request bound."""
    kw = {"max_waiting_tokens": engine_config.max_waiting_tokens}
    if engine_config.max_waiting_requests is not None:
        kw["max_waiting_requests"] = engine_config.max_waiting_requests
    return kw


def _cmd_serve(args) -> int:
    from jaxserve.server import ServerConfig, serve
    try:
        engine_config = EngineConfig(**_engine_kwargs(args))
        config = ServerConfig(served_model_name=args.served_model_name or args.model,
                              api_key=args.api_key, threads=args.threads,
                              http_server=args.http_server,
                              **_admission(engine_config),
                              watchdog_timeout_s=args.watchdog_timeout,
                              enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                              reasoning_parser=args.reasoning_parser,
                              max_stored_responses=args.max_stored_responses)
        modules = args.lora_modules or []
        check_lora_flags(modules, enable_lora=engine_config.enable_lora,
                         served_name=config.served_model_name,
                         data_parallel_size=args.data_parallel_size,
                         executor_backend=args.distributed_executor_backend)
        if args.data_parallel_size is not None:
            return _serve_replicas(args, engine_config, config)
        if args.distributed_executor_backend == "ray":
            return ray_hosts.main("serve", args, engine_config, config)
        _init_distributed(args)
        _reserve_host_cores(args)
        from jaxserve import LLMEngine
        engine = LLMEngine(engine_config)
        _load_lora_modules(engine, modules)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if _follow(engine):
        return 0
    _start_profile(engine, args)  # only with --profile-steps; else POST /start_profile
    try:
        return serve(engine, args.host, args.port, config)
    finally:
        if engine.channel is not None:
            engine.channel.stop()


def _load_lora_modules(engine, modules) -> None:
    """--lora-modules, read before the server opens; a bad one stops the start (LoRAError)."""
    try:
        for adapter in load_lora_modules(engine.lora, modules):
            print(f"[LoRA adapter {adapter.lora_name!r} (id {adapter.lora_int_id}) from "
                  f"{adapter.lora_path}]", file=sys.stderr)
    except ValueError:
        engine.close()
        raise


def _serve_replicas(args, engine_config: EngineConfig, config) -> int:
    """--data-parallel-size N: N engine replicas on Ray Serve behind this process's HTTP app."""
    if args.coordinator_address is not None or args.process_id is not None or \
            args.distributed_executor_backend != "mp":
        raise ValueError("--data-parallel-size runs each replica in its own Ray actor; it does "
                         "not take --coordinator-address / --process-id / "
                         "--distributed-executor-backend (a replica split over hosts is not "
                         "supported yet)")
    if args.profile_dir is not None:
        raise ValueError("--profile-dir profiles one engine process; with "
                         "--data-parallel-size there is none in this process")
    from jaxserve.distributed.launch import ReplicaOptions, start_pool, stop_pool
    from jaxserve.distributed.ray_cluster import RayCluster
    from jaxserve.server.serve import serve_backend
    options = ReplicaOptions(num_replicas=args.data_parallel_size, router=args.router,
                             router_slack=args.router_slack, num_cpus=args.replica_cpus)
    capacity = engine_config.max_num_seqs + config.max_waiting_requests
    with RayCluster(args.ray_address):
        pool = start_pool(_engine_kwargs(args), options, capacity)
        try:
            return serve_backend(pool, args.host, args.port, config)
        finally:
            stop_pool(pool)


def _cmd_bench(args) -> int:
    try:
        config = EngineConfig(warmup=args.warmup, **_engine_kwargs(args))
        _reserve_host_cores(args)
        from jaxserve import LLMEngine
        from jaxserve.tools.workload import make_workload, run_workload
        engine = LLMEngine(config)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    vocab = engine.model.config.vocab_size
    workload = make_workload(args.seed, args.num_requests, args.prompt_len,
                             args.output_len, (min(100, vocab - 1), min(40000, vocab)))
    warm = None
    if not args.warmup:  # an untimed pass of the same requests compiles the shapes they meet
        warm = run_workload(engine, workload)
        engine.reset_stats()
        engine.reset_prefix_cache()  # the timed pass computes its prompts, as the first did
    _start_profile(engine, args)
    result = run_workload(engine, workload)
    _stop_profile(engine)
    s = engine.stats()
    if warm is not None:
        print(f"warm-up pass (untimed, {warm['num_compiles']} compiles): "
              f"{warm['seconds']:.2f}s")
    t, mem = s["step_totals"], s["kv_memory_time_avg"]
    busy = max(1e-9, t["schedule_s"] + t["device_s"] + t["postprocess_s"])
    from jaxserve.tools.machine import describe
    print(f"machine: {describe()}; load average {os.getloadavg()[0]:.1f}")
    print(f"{result['num_requests']} requests, {result['prompt_tokens']} prompt + "
          f"{result['output_tokens']} generated tokens in {result['seconds']:.2f}s: "
          f"{result['output_tok_s']:.1f} generated tok/s, {result['total_tok_s']:.1f} total "
          f"tok/s; {t['num_steps']} steps, {result['num_preemptions']} preemptions, "
          f"{result['num_compiles']} compiles")
    print(f"step time: schedule {t['schedule_s'] / busy:.1%}, device {t['device_s'] / busy:.1%}, "
          f"postprocess {t['postprocess_s'] / busy:.1%} of {busy:.2f}s")
    print(f"KV waste (time-averaged): paged {mem['paged_waste_fraction']:.1%} vs contiguous "
          f"{mem['contiguous_request_waste_fraction']:.1%} (prompt + max_tokens reserved) and "
          f"{mem['contiguous_max_len_waste_fraction']:.1%} (max_model_len reserved); peak "
          f"{mem['peak_requests']} sequences, {mem['peak_blocks_used']} blocks")
    return 0


def _parse_bytes(text: str) -> int:
    """'8e9', '4GiB', '512MB', '1073741824' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3,
             "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
    low = text.strip().lower()
    for unit, scale in units.items():
        if low.endswith(unit):
            return int(float(low[:-len(unit)]) * scale)
    return int(float(low))


def _cmd_kv_size(args) -> int:
    from jaxserve.tools.kv_size import kv_size
    from models.config_io import load_config
    try:
        config = load_config(args.model)
        budget = None if args.budget is None else _parse_bytes(args.budget)
        result = kv_size(config, args.batch, args.seq_len, args.dtype, budget, args.block_size)
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(result.lines(config)))
    return 0


def _add_profile_args(p: argparse.ArgumentParser, serve_like: bool = False) -> None:
    # --profile-dir is an EngineConfig field (_add_engine_args).
    p.add_argument("--profile-steps", type=int, default=None,
                   help="capture only the first N engine steps" +
                        (" (else captures come from the endpoints)" if serve_like else
                         " (default: all)"))
    p.set_defaults(serve_like=serve_like)


def _add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="time a seeded synthetic workload through the engine")
    p.add_argument("model_name", nargs="?", metavar="MODEL", help="overrides --model")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--warmup", action="store_true",
                   help="compile every bucket first instead of an untimed pass of the workload")
    _add_engine_args(p)
    _add_profile_args(p)
    p.set_defaults(func=lambda a: _cmd_bench(_with_model(a)))


def _with_model(args):
    if args.model_name:
        args.model = args.model_name
    return args


def _add_kv_size_parser(sub) -> None:
    p = sub.add_parser("kv-size", help="KV-cache bytes for a model, batch and sequence length")
    p.add_argument("model", help="model name, .gguf file, HF directory / config.json, or orbax "
                                 "checkpoint (only the config is read)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--dtype", default="float16",
                   choices=["float32", "bfloat16", "float16", "float8", "int8"])
    p.add_argument("--budget", default=None,
                   help="memory budget, e.g. 8GiB or 8e9: how many sequences of --seq-len fit")
    p.add_argument("--block-size", type=int, default=16,
                   help="block size for the paged fit (whole blocks plus the null block)")
    p.set_defaults(func=_cmd_kv_size)


def _cmd_quantize(args) -> int:
    from jaxserve.quantization.convert import quantize_model, spec_from_args
    from models import load_model
    from models.checkpoint import save
    try:
        spec = spec_from_args(args.bits, args.group_size, args.symmetric)
        model = load_model(args.model, args.dtype)
        start = time.perf_counter()
        quantized = quantize_model(model, args.method, spec, args.activation_bits,
                                   args.calibration)
        out = save(quantized, args.out)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.method} {quantized.quantization} ({spec}) in "
          f"{time.perf_counter() - start:.1f}s -> {out}  (serve: jaxserve serve --model {out})")
    return 0


def _add_quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model's weights into an orbax checkpoint")
    p.add_argument("model", help="model name, .gguf file, HF directory or orbax checkpoint")
    p.add_argument("--method", default="rtn", help="rtn, gptq or awq")
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--group-size", type=int, default=None, choices=(0, 32, 64, 128),
                   help="rows per group along the input dimension; 0 = per output channel "
                        "(default: 128 for 4 bits, per channel for 8)")
    p.add_argument("--symmetric", action="store_true", help="z = 0 (default: affine)")
    p.add_argument("--activation-bits", type=int, default=16, choices=(16, 8),
                   help="8: serve as W8A8 (int8 per-channel weights only)")
    p.add_argument("--calibration", default=None,
                   help="calibration text file for gptq/awq (default: the built-in text)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--out", required=True, help="new directory for the checkpoint")
    p.set_defaults(func=_cmd_quantize)


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    p.add_argument("model_name", nargs="?", metavar="MODEL", help="overrides --model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $JAXSERVE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for")
    p.add_argument("--threads", type=int, default=64,
                   help="threads running the HTTP handlers (under waitress, one per open "
                        "response; under uvicorn a stream holds one only until accepted)")
    p.add_argument("--http-server", choices=("uvicorn", "waitress"), default="uvicorn",
                   help="uvicorn: asyncio, no thread per open stream (default); waitress: "
                        "WSGI, a thread per open response")
    p.add_argument("--watchdog-timeout", type=float, default=None, metavar="SECONDS",
                   help="mark the engine failed (health 503, exit 1) when it has unfinished "
                        "work and makes no progress for this long (default: off)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's special tokens and chat "
                        "template; lm-eval's tokenizer_backend=remote reads it)")
    # Checked by ServerConfig (importing the server's list here would start JAX for every
    # command), which names the choices.
    p.add_argument("--reasoning-parser", default="none", metavar="{none,qwen3,deepseek_r1}",
                   help="return a <think>...</think> model's thinking as reasoning_content "
                        "(chat) / reasoning items (responses), apart from its answer; qwen3 and "
                        "deepseek_r1 (vLLM's names) read the same format (default: none)")
    p.add_argument("--max-stored-responses", type=int, default=0, metavar="N",
                   help="keep the last N /v1/responses results with store: true in memory "
                        "for previous_response_id and GET /v1/responses/{id} (default 0: "
                        "none; store: true is answered as store: false)")
    g = p.add_argument_group("replicas (Ray Serve; pip install 'jaxserve[ray]')")
    g.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                   help="serve N engine replicas as Ray Serve deployments behind this "
                        "endpoint (even N=1 goes through Ray); default: one engine in this "
                        "process, no Ray")
    g.add_argument("--router", default="prefix", choices=("prefix", "round_robin",
                                                         "least_loaded"),
                   help="how requests pick a replica: the one most likely to hold the "
                        "prompt's prefix in its KV cache, balanced against load (default), "
                        "or round-robin / least-loaded")
    g.add_argument("--router-slack", type=int, default=2, metavar="K",
                   help="prefix routing passes over a replica holding the prefix when it runs "
                        "more than K requests beyond the least loaded one (default 2)")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="Ray CPUs each replica reserves (default 1)")
    add_lora_modules_arg(p.add_argument_group(
        "LoRA adapters (with --enable-lora --max-loras --max-lora-rank --max-cpu-loras; "
        "docs/lora.md)"))
    _add_engine_args(p)
    _add_profile_args(p, serve_like=True)
    p.set_defaults(func=lambda a: _cmd_serve(_with_model(a)))


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as a flag, with the dataclass's default and help."""
    add_config_args(p.add_argument_group("engine (EngineConfig fields)"), EngineConfig)
    g = p.add_argument_group("multi-host (jax.distributed.initialize; run on every host, or "
                             "let Ray start them)")
    g.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None, help="0 schedules and serves")
    g.add_argument("--distributed-executor-backend", default="mp", choices=ray_hosts.BACKENDS,
                   help="mp: you start every process (the flags above); ray: one command "
                        "starts --num-processes Ray actors, one per host (docs/parallelism.md)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (HOST:PORT, ray://HOST:PORT) for replicas or "
                        "a Ray-launched multi-host run; default: $RAY_ADDRESS, else a local "
                        "cluster started for the command and stopped with it")
    g.add_argument("--ray-placement-strategy", default=None, choices=ray_hosts.PLACEMENTS,
                   help="Ray placement of the host processes (default: STRICT_SPREAD, one per "
                        "node, on a joined cluster; PACK on the local one)")
    p.add_argument("--host-cores", type=int, default=0, metavar="N",
                   help="CPUs kept for the engine's host loop, apart from XLA's CPU thread pool "
                        "(Linux). Pays on a CPU backend when the host work per step is like "
                        "the device's (small models, many sequences); a model whose step is "
                        "mostly matmul loses those CPUs' compute. Default 0: the pool on every "
                        "CPU (docs/performance.md, the engine loop)")


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
    # --seed is the engine's (EngineConfig.seed): each prompt draws its sampling seed from it.
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
    _add_profile_args(p)
    p.set_defaults(func=_cmd_generate)
    _add_serve_parser(sub)
    _add_bench_parser(sub)
    _add_kv_size_parser(sub)
    _add_quantize_parser(sub)
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    parser = build_parser()
    args = parser.parse_args(argv)
    steps = getattr(args, "profile_steps", None)
    if steps is not None and (steps < 1 or args.profile_dir is None):
        parser.error("--profile-steps takes a positive number of steps and needs --profile-dir")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
