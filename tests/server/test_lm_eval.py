"""lm-evaluation-harness against the server, as a user runs it: `lm_eval --model
local-completions` (from the HF reference environment, .venv-ref, which has torch) on the two
tiny local tasks of tests/lm_eval_tasks/ (a jsonl each, no hub), tokenizing through the
server's own /tokenize and /detokenize (`tokenizer_backend=remote`, which reads GET
/tokenizer_info), so no tokenizer files are needed. One in-process server on the tiny chat
model with an API key; every request body the server gets is recorded, so the test checks
what lm-eval sent as well as the scores it wrote.

The multiple-choice task scores choices by loglikelihood: lm-eval asks /v1/completions for
`echo: true, logprobs: 1, max_tokens: 1` over the prompt's token ids, answered with prompt
logprobs.
"""

import json
import os
import pathlib
import subprocess

import pytest
from flask import request

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig
from http_server import serving
from hf_reference import reference_python
from jaxserve.testing.tiny_chat import tiny_chat_model
from jaxserve.testing.tiny_models import TINY_CHAT

pytestmark = [pytest.mark.subprocess, pytest.mark.hf_ref]

TASKS = pathlib.Path(__file__).resolve().parent.parent / "lm_eval_tasks"
MODEL = "tiny-chat"
KEY = "lm-eval-key"
MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 4
LM_EVAL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def lm_eval_bin():
    py = reference_python()
    tool = py.parent / "lm_eval" if py is not None else None
    if tool is None or not tool.exists():
        pytest.skip("lm_eval missing from the HF reference environment: run "
                    "`bash scripts/setup.sh --test` (tests/requirements-ref.txt has lm-eval)")
    return tool


@pytest.fixture(scope="module")
def server():
    model = tiny_chat_model(seed=0)
    kv = 4 * MAX_NUM_SEQS * MAX_MODEL_LEN * TINY_CHAT.kv_bytes_per_token(4)
    engine = LLMEngine(EngineConfig(model=model.source, warmup=True, max_num_seqs=MAX_NUM_SEQS,
                                    max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64,
                                    block_size=MAX_MODEL_LEN, kv_cache_memory=kv), model=model)
    loop = EngineLoop(engine).start()
    config = ServerConfig(served_model_name=MODEL, api_key=KEY,
                          enable_tokenizer_info_endpoint=True)
    with serving(loop, config) as s:
        s.log = []  # (path, JSON body, status) of every request, in order

        @s.app.before_request
        def keep_body():
            request.get_data()  # cached: the handler reads it again, and so does record()

        @s.app.after_request
        def record(response):
            s.log.append((request.path, request.get_json(silent=True), response.status_code))
            return response

        yield s
    loop.stop()


class LmEvalFailed(AssertionError):
    """lm_eval exited non-zero (what the multiple-choice test expects until prompt logprobs)."""


def run_lm_eval(lm_eval_bin, server, task: str, tmp_path) -> dict:
    """Runs one task; returns lm-eval's results JSON (LmEvalFailed, with its output, if it
    fails). server.sent is what the server got meanwhile."""
    start = len(server.log)
    args = ",".join([f"model={MODEL}", f"base_url={server.url}/v1/completions",
                     "tokenizer_backend=remote", f"auth_token={KEY}", "num_concurrent=1",
                     "max_retries=1", f"max_length={MAX_MODEL_LEN}"])
    env = dict(os.environ, OPENAI_API_KEY=KEY, HF_HOME=str(tmp_path / "hf"),
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(lm_eval_bin), "--model", "local-completions", "--model_args", args,
                           "--include_path", ".", "--tasks", task,
                           "--output_path", str(tmp_path / "out")],
                          cwd=TASKS, env=env, capture_output=True, text=True,
                          timeout=LM_EVAL_TIMEOUT_S)
    server.sent = server.log[start:]
    if proc.returncode != 0:
        statuses = sorted({(path, status) for path, _, status in server.sent})
        raise LmEvalFailed(f"lm_eval failed (the server answered {statuses}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    [results] = (tmp_path / "out").rglob("results_*.json")
    return json.loads(results.read_text())["results"][task]


def is_one_token_prompt(prompt) -> bool:
    return len(prompt) == 1 and len(prompt[0]) > 1 and \
        all(isinstance(t, int) for t in prompt[0])


def completions(server) -> list[dict]:
    return [body for path, body, _ in server.sent if path == "/v1/completions"]


@pytest.mark.timeout(LM_EVAL_TIMEOUT_S + 120)
def test_generate_until_task(lm_eval_bin, server, tmp_path):
    result = run_lm_eval(lm_eval_bin, server, "jaxserve_tiny_gen", tmp_path)
    score = result["exact_match,none"]
    assert isinstance(score, float) and 0.0 <= score <= 1.0, result
    sent = completions(server)
    assert len(sent) == 4  # one greedy completion per document
    for body in sent:
        assert body["model"] == MODEL and body["max_tokens"] == 8 and body["temperature"] == 0
        assert body["stop"] == ["\n", "<|endoftext|>"]  # the eos /tokenizer_info names
        # Tokenized by the server's /tokenize: the prompt comes back as a batch of one
        # token-id list.
        assert is_one_token_prompt(body["prompt"]), body
    assert all(status == 200 for _, _, status in server.sent)
    assert any(path == "/tokenize" for path, _, _ in server.sent)


# What lm-eval sent is checked even when it fails (finally).
@pytest.mark.timeout(LM_EVAL_TIMEOUT_S + 120)
def test_multiple_choice_task(lm_eval_bin, server, tmp_path):
    try:
        result = run_lm_eval(lm_eval_bin, server, "jaxserve_tiny_mc", tmp_path)
    finally:
        scoring = completions(server)
        # Each choice is scored by the loglikelihood of its tokens after the question's: the
        # whole sequence as token ids, echoed with one logprob per prompt token.
        assert scoring, server.sent
        for body in scoring:
            assert body["echo"] is True and body["logprobs"] == 1, body
            assert body["max_tokens"] == 1 and body["temperature"] == 0, body
            assert is_one_token_prompt(body["prompt"]), body
    assert len(scoring) == 12  # 4 questions x 3 choices
    acc = result["acc,none"]
    assert acc in (0.0, 0.25, 0.5, 0.75, 1.0), result  # 4 questions
