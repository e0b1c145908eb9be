"""KV-cache events on the wire (--kv-events-endpoint), read back by a ZMQ subscriber.

The reference of the format is the set of msgspec structs declared here, as vLLM declares them
(vllm/distributed/kv_events.py, array encoding: positional batch, tagged positional events) and
as llm-d's indexer and Dynamo's router decode them: a batch that does not decode into them fails
the test. What the events say is checked against the prompts the test sent (their full blocks'
tokens and hash chain, computed here) and against the engine's own prefix cache: replaying the
stream gives exactly the hashes the cache holds, after evictions and resets alike.

PUB/SUB drops what is published before a subscriber has joined, so each subscriber first waits
for a probe request's batch, then resets the prefix cache: from the AllBlocksCleared on, the
stream is complete.
"""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.core.prefix_cache import hash_block
from jaxserve.testing.tiny_models import TINY_GQA
from models.random_init import random_model

BS = 4
NUM_BLOCKS = 1 + 8  # the null block and 8 usable: a third 3-block prompt evicts


# ---- the format, declared independently of jaxserve --------------------------------------

class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class Stored(Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class Removed(Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class Cleared(Event, tag="AllBlocksCleared"):
    pass


DECODER = msgspec.msgpack.Decoder(Batch)


def wire_chain(tokens: list[int]) -> list[int]:
    """vLLM-style 64-bit block hashes of `tokens`' full blocks: the sha256 chain's low 64 bits."""
    hashes, parent = [], b""
    for i in range(0, len(tokens) // BS * BS, BS):
        parent = hash_block(parent, tokens[i:i + BS])
        hashes.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return hashes


# ---- engine and subscriber ----------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_GQA, seed=7)


def make_engine(model, endpoint, **kw):
    return LLMEngine(EngineConfig(
        model="tiny", block_size=BS, max_num_seqs=4, max_num_batched_tokens=32,
        max_model_len=24, warmup=False, kv_cache_memory=NUM_BLOCKS * BS *
        TINY_GQA.kv_bytes_per_token(4), kv_events_endpoint=endpoint, **kw), model=model)


def run(engine, *prompts, max_tokens=1):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(engine.next_request_id(), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


class Subscriber:
    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(address)
        self.seqs: list[int] = []
        self.batches: list[Batch] = []

    def read(self, quiet_s=0.3, timeout_s=10.0) -> list[Batch]:
        """Batches arriving until none came for quiet_s (at least one unless timeout_s)."""
        got, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.sock.poll(int(quiet_s * 1000)):
                if got:
                    break
                continue
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"" and len(seq) == 8
            self.seqs.append(int.from_bytes(seq, "big"))
            got.append(DECODER.decode(payload))  # fails unless it is vLLM's shape
        self.batches += got
        return got

    def join(self, engine, model):
        """Probes until a batch arrives, then resets the cache: the stream is complete from the
        AllBlocksCleared on (returned: the batches after the probe's)."""
        for probe in range(50):
            run(engine, [200 + probe] * (BS + 1))
            if self.sock.poll(200):
                break
        else:
            raise AssertionError("no KV-event batch reached the subscriber")
        self.read()
        assert engine.reset_prefix_cache() > 0
        (batch,) = self.read()
        assert batch.events[-1] == Cleared()
        self.batches, first = [], len(self.seqs)
        return first

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


def replay(batches: list[Batch]) -> set[int]:
    """The block hashes a router's index holds after these batches."""
    held: set[int] = set()
    for batch in batches:
        for e in batch.events:
            if isinstance(e, Stored):
                assert not held & set(e.block_hashes), "stored twice without a removal"
                held |= set(e.block_hashes)
            elif isinstance(e, Removed):
                assert set(e.block_hashes) <= held, "removed a block never stored"
                held -= set(e.block_hashes)
            else:
                held.clear()
    return held


def engine_hashes(engine) -> set[int]:
    return {int.from_bytes(h, "big") & ((1 << 64) - 1)
            for h in engine.scheduler.block_manager.cache.hash_of.values()}


@pytest.fixture(scope="module")
def published(model):
    """(engine, subscriber) joined to its stream; the engine binds a wildcard tcp port."""
    port = free_port()
    engine = make_engine(model, f"tcp://*:{port}")
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    try:  # also when joining fails: an open socket would hang the interpreter's exit
        sub.join(engine, model)
        yield engine, sub
    finally:
        sub.close()
        engine.close()


# ---- tests --------------------------------------------------------------------------------

def test_stored_blocks_are_the_prompts_full_blocks(published):
    engine, sub = published
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # 2 full blocks + 3 tokens
    run(engine, prompt)
    events = [e for b in sub.read() for e in b.events]
    assert events == [Stored(wire_chain(prompt), None, prompt[:8], BS, None, "GPU", None)]
    # Sharing the first block: only the new second block, as a child of the first.
    other = prompt[:4] + [30, 31, 32, 33, 34]
    run(engine, other)
    events = [e for b in sub.read() for e in b.events]
    assert events == [Stored(wire_chain(other)[1:], wire_chain(prompt)[0], other[4:8], BS,
                             None, "GPU", None)]
    assert replay(sub.batches) == engine_hashes(engine)


def test_evictions_are_removed_and_the_index_follows_the_cache(published):
    engine, sub = published
    evictions = engine.stats()["prefix_cache_evictions"]
    prompts = [[40 + 10 * i + j for j in range(3 * BS + 1)] for i in range(4)]
    for prompt in prompts:  # 4 blocks each, 3 of them cached after: the third evicts
        run(engine, prompt)
    batches = sub.read()
    removed = [h for b in batches for e in b.events if isinstance(e, Removed)
               for h in e.block_hashes]
    assert len(removed) == engine.stats()["prefix_cache_evictions"] - evictions > 0
    stored = {h for p in prompts for h in wire_chain(p)}
    assert {h for b in batches for e in b.events if isinstance(e, Stored)
            for h in e.block_hashes} == stored
    assert replay(sub.batches) == engine_hashes(engine)


def test_reset_clears_and_sequence_numbers_increase(published):
    engine, sub = published
    run(engine, [90 + j for j in range(2 * BS + 1)])
    sub.read()
    assert engine.reset_prefix_cache() > 0
    (batch,) = sub.read()
    assert batch.events == [Cleared()] and batch.data_parallel_rank == 0
    assert replay(sub.batches) == engine_hashes(engine) == set()
    assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
    assert all(a.ts <= b.ts for a, b in zip(sub.batches, sub.batches[1:]))


def test_rank_offsets_the_port_and_is_stamped(model):
    port = free_port() - 1  # rank 1 binds port + 1
    engine = make_engine(model, f"tcp://*:{port}", data_parallel_rank=1)
    sub = Subscriber(f"tcp://127.0.0.1:{port + 1}")
    try:
        sub.join(engine, model)
        run(engine, [7] * (BS + 1))
        (batch,) = sub.read()
        assert batch.data_parallel_rank == 1 and len(batch.events) == 1
    finally:
        sub.close()
        engine.close()
    assert engine.kv_event_sink is None
    # Closed: the port is free again.
    with zmq.Context() as ctx, ctx.socket(zmq.PUB) as s:
        s.bind(f"tcp://*:{port + 1}")


@pytest.mark.parametrize("endpoint, message", [
    ("localhost:5557", "must look like"), ("tcp://*", "must look like"),
    ("tcp://*:0", "1..65535"), ("ipc://", "must look like"), ("http://x:1", "must look like")])
def test_bad_endpoints_are_refused(endpoint, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(kv_events_endpoint=endpoint)


def test_events_need_prefix_caching_and_a_rank_of_zero_or_more():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        EngineConfig(data_parallel_rank=-1)
    with pytest.raises(ValueError, match="65535"):
        EngineConfig(kv_events_endpoint="tcp://*:65535", data_parallel_rank=1)


def test_an_adapters_stored_blocks_carry_its_lora_id():
    from jaxserve.core.kv_events import BlockStored
    from jaxserve.telemetry.kv_event_wire import encode_batch
    enc = msgspec.msgpack.Encoder()
    events = [BlockStored((b"\x01" * 32,), None, (1, 2, 3, 4), BS, lora_id=3),
              BlockStored((b"\x02" * 32,), None, (1, 2, 3, 4), BS)]
    batch = DECODER.decode(encode_batch(enc, 1.0, events, 0))
    assert [e.lora_id for e in batch.events] == [3, None]
