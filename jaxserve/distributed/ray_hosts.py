"""Multi-host tensor parallelism launched by Ray (`--distributed-executor-backend ray`).

One command starts N actors, one per host process, each in its own bundle of a placement group.
Actor 0 picks a free port on its node: its IP and that port are the coordinator address. Every
actor then runs the ordinary multi-controller path (`multihost.initialize(coordinator, N, i)`,
the engine from the same config); actor 0 runs the command and the others follow its steps
(`jaxserve.cli.run_on_host`). The driver sends plain config (dicts of the EngineConfig and
ServerConfig fields, the command's flags) and gets plain results back; no engine object crosses
a process. An actor that fails or dies ends the run: the driver stops the others and raises
`HostFailed`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
import time
from typing import Literal, get_args

from jaxserve.distributed.ray_cluster import RayCluster, import_ray

log = logging.getLogger("jaxserve.distributed")

Backend = Literal["mp", "ray"]
Placement = Literal["STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"]  # Ray's strategies
BACKENDS = get_args(Backend)
PLACEMENTS = get_args(Placement)
# Variables an actor takes from the driver's environment (runtime_env), on any node: what JAX
# and XLA read at start (JAX_PLATFORMS, XLA_FLAGS' device count), NCCL's settings, the model
# cache (HF_*) and jaxserve's own.
FORWARDED_ENV = ("JAX_", "XLA_", "NCCL_", "HF_", "JAXSERVE_", "TF_CPP_")
PLACEMENT_TIMEOUT_S = 120.0  # the bundles are placed (nodes exist with the resources)
START_TIMEOUT_S = 300.0  # actor 0 is up and reports the coordinator address
FOLLOW_TIMEOUT_S = 120.0  # the followers end after process 0 has stopped them
POLL_S = 1.0  # how often the driver looks at the actors (and sees Ctrl-C)


class HostFailed(RuntimeError):
    """A host process raised, died, or did not come up in time; the others are stopped."""


def check_flags(args: argparse.Namespace) -> None:
    """The multi-host flags that make sense with --distributed-executor-backend ray (no Ray
    needed to check them)."""
    if args.coordinator_address is not None or args.process_id is not None:
        raise ValueError("--distributed-executor-backend ray picks the coordinator address and "
                         "each process's id itself: drop --coordinator-address/--process-id")
    if args.num_processes is None or args.num_processes < 1:
        raise ValueError("--distributed-executor-backend ray needs --num-processes N (one Ray "
                         "actor per host process)")
    if args.tensor_parallel_size % args.num_processes:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} is not a multiple "
                         f"of --num-processes {args.num_processes}: each process holds "
                         "tensor_parallel_size / num_processes devices")


def forwarded_env(environ=None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV)}


def main(command: str, args: argparse.Namespace, engine_config, server_config=None) -> int:
    """The command's exit status; `generate` prints what process 0 generated, as `generate`
    does in one process. ValueError: flags that do not fit (before Ray starts) or no Ray."""
    from jaxserve.cli import print_generated
    server = None if server_config is None else dataclasses.asdict(server_config)
    try:
        result = launch(command, args, dataclasses.asdict(engine_config), server)
    except HostFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # serve: the driver waits until interrupted
        print("[interrupted: stopped the host processes]", file=sys.stderr)
        return 0
    if command == "generate":
        print_generated(result["generated"])
        return 0
    return result["status"]


def launch(command: str, args: argparse.Namespace, config: dict, server: dict | None = None
           ) -> dict:
    """Runs `command` ("generate" or "serve") on N Ray actors; returns process 0's result.

    Joins `args.ray_address` (or $RAY_ADDRESS), else starts a local cluster for the run. The
    placement defaults to STRICT_SPREAD (one host each) on a joined cluster and PACK on the
    local one, which is a single node; `--ray-placement-strategy` overrides both."""
    check_flags(args)
    flags = {k: v for k, v in vars(args).items() if k != "func"}  # plain values only
    with RayCluster(args.ray_address) as cluster:
        strategy = args.ray_placement_strategy or ("PACK" if cluster.local else "STRICT_SPREAD")
        ray = import_ray()
        gpus = 0
        if ray.cluster_resources().get("GPU", 0) > 0:  # each process owns its share of devices
            gpus = args.tensor_parallel_size // args.num_processes
        with RayHosts(args.num_processes, strategy, forwarded_env(), gpus) as hosts:
            return hosts.run(command, flags, config, server)


class RayHosts:
    """`with RayHosts(n, strategy, env):` a placement group of n bundles and one actor in each;
    `run(...)` runs a command on them; on exit the actors are killed and the group removed."""

    def __init__(self, num_processes: int, strategy: Placement, env: dict[str, str],
                 gpus_per_process: int = 0):
        if strategy not in PLACEMENTS:
            raise ValueError(f"placement strategy must be one of {PLACEMENTS}, got {strategy!r}")
        self.n, self.strategy, self.env, self.gpus = num_processes, strategy, env, gpus_per_process
        self.group = None
        self.actors = []

    def __enter__(self) -> "RayHosts":
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        bundle = {"CPU": 1, **({"GPU": self.gpus} if self.gpus else {})}
        self.group = placement_group([dict(bundle) for _ in range(self.n)], self.strategy)
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.__exit__()
            raise HostFailed(
                f"Ray could not place {self.n} bundles of {bundle} with {self.strategy} in "
                f"{PLACEMENT_TIMEOUT_S:.0f}s (cluster: {ray.cluster_resources()}); STRICT_SPREAD "
                "needs one node per process: on one machine use --ray-placement-strategy PACK"
            ) from None
        actor = ray.remote(HostProcess)
        self.actors = [actor.options(
            num_cpus=1, num_gpus=self.gpus, runtime_env={"env_vars": self.env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=i)).remote() for i in range(self.n)]
        log.info("%d host processes on Ray (%s)", self.n, self.strategy)
        return self

    def __exit__(self, *exc) -> None:
        ray = import_ray()
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.group)
            self.group = None

    def run(self, command: str, flags: dict, config: dict, server: dict | None) -> dict:
        """Process 0's result once every process has ended (Ctrl-C reaches the caller)."""
        ray = import_ray()
        try:
            coordinator = ray.get(self.actors[0].coordinator_address.remote(),
                                  timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise HostFailed(f"host process 0 did not start in {START_TIMEOUT_S:.0f}s") from None
        except ray.exceptions.RayError as e:
            raise HostFailed(f"host process 0 failed to start: {_reason(e)}") from None
        log.info("coordinator %s", coordinator)
        refs = [a.run.remote(coordinator, self.n, i, command, flags, config, server)
                for i, a in enumerate(self.actors)]
        return self.wait(refs)[0]

    def wait(self, refs: list) -> list:
        """Each process's result, in order; HostFailed as soon as one raises or dies, or when
        the followers outlive process 0 by FOLLOW_TIMEOUT_S."""
        ray = import_ray()
        index = {ref: i for i, ref in enumerate(refs)}
        results, pending, leader_done = {}, list(refs), None
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            for ref in done:
                try:
                    results[index[ref]] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise HostFailed(f"host process {index[ref]} of {self.n} failed: "
                                     f"{_reason(e)}") from None
            if 0 in results and leader_done is None:
                leader_done = time.monotonic()
            if pending and leader_done and time.monotonic() - leader_done > FOLLOW_TIMEOUT_S:
                late = sorted(index[r] for r in pending)
                raise HostFailed(f"host processes {late} still run {FOLLOW_TIMEOUT_S:.0f}s "
                                 "after process 0 ended")
        return [results[i] for i in range(len(refs))]


def _reason(e: Exception) -> str:
    """The error an actor raised (not Ray's wrapper and remote traceback), or why it died."""
    cause = getattr(e, "cause", None)
    if cause is not None and not isinstance(cause, type(e)):
        return f"{type(cause).__name__}: {cause}"
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


class HostProcess:
    """One host process of the run (a Ray actor; `ray.remote` is applied by RayHosts, so this
    module imports without Ray)."""

    def coordinator_address(self) -> str:
        """This node's IP and a port free on it now: where process 0's coordinator listens."""
        from ray.util import get_node_ip_address
        ip = get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ip}:{port}"

    def run(self, coordinator: str, num_processes: int, process_id: int, command: str,
            flags: dict, config: dict, server: dict | None) -> dict:
        from jaxserve.cli import run_on_host
        from jaxserve.runtime import multihost
        # Ray forwards an actor's stdout to the driver's stdout, where `generate` prints its
        # texts alone: what the host processes (and gloo, from C++) print goes to stderr.
        sys.stdout.flush()
        os.dup2(2, 1)
        multihost.initialize(coordinator, num_processes, process_id)
        return run_on_host(command, argparse.Namespace(**flags), config, server)
