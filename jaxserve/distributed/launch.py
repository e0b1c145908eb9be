"""Starting N engine replicas as Ray Serve deployments and the pool that routes to them.

One deployment of one replica per rank (`replica-0` ... `replica-{N-1}`), each an application
of its own without an HTTP route: the Flask app is the HTTP layer and routes itself (router.py),
which needs a handle per replica. Ray Serve keeps each deployment at one healthy replica: it
restarts a replica whose actor died or whose `check_health` failed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import tempfile

from jaxserve.distributed.pool import ReplicaPool
from jaxserve.distributed.replica import EngineReplica
from jaxserve.distributed.router import ReplicaRouter
from jaxserve.server.backend import ServedModel

log = logging.getLogger("jaxserve.distributed")
APP_PREFIX = "jaxserve-replica-"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaOptions:
    """How replicas are placed and watched (Ray Serve deployment options)."""

    num_replicas: int = 1
    router: str = "prefix"
    # Prefix routing's load slack: a replica more than this many requests busier than the
    # least loaded one is passed over even when it holds the prompt's prefix.
    router_slack: int = 2
    # Ray resources each replica reserves. GPUs: None = one per device its engine uses
    # (tensor_parallel_size) when the cluster has GPUs, else none.
    num_cpus: float = 1.0
    num_gpus: float | None = None
    # Ray Serve's health probe (EngineReplica.check_health) period and timeout.
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0

    def __post_init__(self):
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) or \
                self.num_replicas < 1:
            raise ValueError(f"--data-parallel-size must be a positive integer, got "
                             f"{self.num_replicas!r}")
        if self.num_cpus < 0 or (self.num_gpus is not None and self.num_gpus < 0):
            raise ValueError("replica CPUs and GPUs must be >= 0")


def replica_env() -> dict[str, str]:
    """Environment of each replica process. OMP_NUM_THREADS: Ray caps it at the CPUs a worker
    reserved (1 for `--replica-cpus` below 2) when unset, while XLA's own thread pool uses every
    core; a mix that made each token about 20% slower on a 2-CPU machine. Replicas take this
    command's OMP_NUM_THREADS, else this machine's CPU count."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or
            str(len(os.sched_getaffinity(0)))}


def served_model(info: dict) -> ServedModel:
    """The driver's view of the model from a replica's `describe()`: its tokenizer rebuilt
    from the files it sent, and a grammar compiler when the replicas serve structured output."""
    from jaxserve.core.grammar import GrammarCompiler
    from models.tokenizer import Tokenizer
    tok = None
    if info["tokenizer_files"] is not None:
        with tempfile.TemporaryDirectory() as d:
            for name, text in info["tokenizer_files"].items():
                (pathlib.Path(d) / name).write_text(text, encoding="utf-8")
            tok = Tokenizer.from_hf_dir(d)
    grammar = GrammarCompiler(tok.to_json(), vocab_size=info["vocab_size"],
                              eos_ids=info["eos_ids"]) \
        if info["structured_outputs"] and tok is not None else None
    return ServedModel(tok, info["vocab_size"], info["max_model_len"], info["max_num_seqs"],
                       info["block_size"], grammar)


def start_pool(engine_kwargs: dict, options: ReplicaOptions, capacity: int) -> ReplicaPool:
    """Deploys the replicas (Ray must be initialized) and returns the started pool.

    `capacity`: requests one replica may hold (running + waiting); Ray Serve is told to let
    that many (plus the pool's own calls) through to it at once."""
    import ray
    from ray import serve
    gpus = options.num_gpus
    if gpus is None:
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        gpus = float(engine_kwargs.get("tensor_parallel_size", 1)) if has_gpus else 0.0
    serve.start(proxy_location="Disabled")  # the Flask app serves HTTP
    deployment = serve.deployment(EngineReplica)
    handles = {}
    for rank in range(options.num_replicas):
        name = f"replica-{rank}"
        # The rank offsets the replica's KV-event port and is stamped on its event batches.
        kwargs = dict(engine_kwargs, data_parallel_rank=rank)
        app = deployment.options(
            name=name, num_replicas=1, max_ongoing_requests=capacity + 16,
            health_check_period_s=options.health_check_period_s,
            health_check_timeout_s=options.health_check_timeout_s,
            ray_actor_options={"num_cpus": options.num_cpus, "num_gpus": gpus,
                               "runtime_env": {"env_vars": replica_env()}},
            # A log line per call (token streams, the pool's stats polls) would drown the rest.
            logging_config={"enable_access_log": False},
        ).bind(name, kwargs)
        log.info("starting engine replica %s", name)
        handles[name] = serve.run(app, name=APP_PREFIX + name, route_prefix=None)
    first = handles["replica-0"].describe.remote().result()
    router = ReplicaRouter(list(handles), options.router, first["block_size"],
                           slack=options.router_slack)
    return ReplicaPool(handles, served_model(first), router).start()


def stop_pool(pool: ReplicaPool) -> None:
    """Stops routing and deletes the replicas' applications (the cluster stays up)."""
    from ray import serve
    pool.stop()
    for name in pool.replicas():
        serve.delete(APP_PREFIX + name)

