"""`--distributed-executor-backend ray`: the host processes of a multi-host run as Ray actors.

On a local Ray cluster on this machine: two actors with one CPU device each (tensor parallel
over both processes, gloo collectives) against one process with one device; the flags the
launcher refuses before Ray starts; a host process that dies ends the run.
"""

import logging
import sys

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve import cli
from jaxserve.testing.tiny_chat import tiny_chat_model
from models.checkpoint import save

PROMPTS = ["The capital of France", "def add(a, b):"]
MAX_TOKENS = 6
ENGINE = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32,
              kv_cache_memory=4 << 20, warmup=False)
FLAGS = ["--max-num-seqs", "2", "--max-model-len", "64", "--max-num-batched-tokens", "32",
         "--kv-cache-memory", str(4 << 20), "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]
RAY = ["--distributed-executor-backend", "ray"]


@pytest.fixture
def no_ray_left():
    """Whatever a test started, Ray is shut down after it."""
    yield
    if "ray" in sys.modules and sys.modules["ray"] is not None:
        sys.modules["ray"].shutdown()


@pytest.mark.parametrize("argv,message", [
    (RAY + ["--num-processes", "2", "--coordinator-address", "h:1"], "drop --coordinator"),
    (RAY + ["--num-processes", "2", "--process-id", "0"], "drop --coordinator"),
    (RAY, "needs --num-processes"),
    (RAY + ["--num-processes", "2", "--tensor-parallel-size", "3"], "not a multiple"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_refuses_flags_the_launcher_picks(capsys, no_ray_left, command, argv, message):
    args = [command, "hi"] if command == "generate" else [command]
    assert cli.main(args + ["--model", "no-such-model", *argv]) == 2
    assert message in capsys.readouterr().err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_cli_without_ray_says_how_to_install_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert cli.main(["generate", "hi", *RAY, "--num-processes", "2",
                     "--tensor-parallel-size", "2"]) == 2
    assert "this needs Ray: pip install 'jaxserve[ray]'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A checkpoint the actors load (no model object crosses a process)."""
    return str(save(tiny_chat_model(seed=3), tmp_path_factory.mktemp("ray") / "tiny"))


@pytest.mark.subprocess
@pytest.mark.timeout(900)
def test_two_actors_give_the_greedy_tokens_of_one_process(model_dir, capsys, caplog,
                                                          monkeypatch, no_ray_left):
    pytest.importorskip("ray")
    llm = LLM(model=model_dir, **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    want = [list(o.outputs[0].token_ids) for o in outs]
    texts = [o.outputs[0].text for o in outs]
    capsys.readouterr()

    got = []  # what the driver prints, as the plain data actor 0 sent back
    printer = cli.print_generated
    monkeypatch.setattr(cli, "print_generated", lambda r: (got.append(r), printer(r)))
    # The actors' environment (runtime_env): one CPU device per process.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    # A local cluster (the command starts and stops it), so the default placement is PACK.
    caplog.set_level(logging.INFO, logger="jaxserve.distributed")
    assert cli.main(["generate", *PROMPTS, "--model", model_dir, *FLAGS, *RAY,
                     "--tensor-parallel-size", "2", "--num-processes", "2"]) == 0
    out = capsys.readouterr()
    assert len(want) == 2 and all(len(t) == MAX_TOKENS for t in want)
    assert [o["token_ids"] for o in got[0]["outputs"]] == want
    assert out.out.splitlines() == texts  # stdout is the texts alone, as in one process
    assert "2 host processes on Ray (PACK)" in caplog.text


@pytest.fixture
def local_ray(no_ray_left):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return ray


@pytest.mark.subprocess
@pytest.mark.timeout(300)
def test_a_dead_host_process_ends_the_run(local_ray, model_dir):
    """Process 1 dies before it joins: process 0 would wait in jax.distributed.initialize; the
    driver sees the death, raises, and its `with` stops process 0."""
    from jaxserve.distributed.ray_hosts import HostFailed, RayHosts
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    with RayHosts(2, "PACK", env) as hosts:
        leader = hosts.actors[0]
        coordinator = local_ray.get(leader.coordinator_address.remote(), timeout=120)
        flags = vars(cli.build_parser().parse_args(["generate", "hi", "--model", model_dir]))
        flags.pop("func")
        refs = [a.run.remote(coordinator, 2, i, "generate", flags, {"model": model_dir}, None)
                for i, a in enumerate(hosts.actors)]
        local_ray.kill(hosts.actors[1])
        with pytest.raises(HostFailed, match="host process 1 of 2 failed"):
            hosts.wait(refs)
    with pytest.raises(local_ray.exceptions.RayActorError):  # the leader was stopped too
        local_ray.get(leader.coordinator_address.remote(), timeout=60)
