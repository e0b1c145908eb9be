"""One of two processes of a multi-host run on loopback (tests/runtime/test_tensor_parallel.py).

`python tests/mh_worker.py PROCESS_ID PORT`: each process has one CPU device; the two form a
tensor-parallel mesh of 2 through jax.distributed (gloo collectives). Process 0 schedules and
prints the greedy tokens of two workloads (plain prompts, then shared prefixes with n > 1, which
hit the prefix cache and copy blocks on write), the plain prompts' prompt logprobs (a step
variant the follower must replay) and its counters; process 1 follows its broadcast
calls and prints how many steps and copies it ran.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tp_worker as w  # noqa: E402  (after XLA_FLAGS: one device per process)

from jaxserve.runtime import multihost  # noqa: E402
from models.model import enable_compilation_cache  # noqa: E402
from models.random_init import random_model  # noqa: E402


def main(process_id: int, port: int) -> int:
    # As tp_worker's runs: a random model is not loaded through load_model, which turns the
    # persistent cache on; without it both processes compile every step program on every run.
    enable_compilation_cache()
    multihost.initialize(f"127.0.0.1:{port}", 2, process_id)
    eng = w.engine(random_model(w.GQA, seed=3), 2)
    if multihost.is_leader():
        try:
            result = {"tokens": w.greedy(eng, w.prompts(w.GQA.vocab_size)),
                      "waves": w.greedy_waves(eng, w.shared_prefix_waves(w.GQA.vocab_size)),
                      "prompt_logprobs": w.prompt_logprobs(eng, w.prompts(w.GQA.vocab_size))}
            stats = eng.stats()
            result["stats"] = {k: stats[k] for k in ("cow_copies", "prefix_cache_hits_blocks")}
        finally:
            eng.channel.stop()
    else:
        result = eng.channel.follow()
    result["devices"] = [len(eng.runner.cache.k.addressable_shards),
                         len(eng.runner.cache.k.sharding.device_set)]
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
