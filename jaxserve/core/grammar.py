"""The grammar engine (llguidance): compiles constraints off the engine thread, fills bitmasks.

llguidance, not xgrammar: its wheel needs nothing else (xgrammar 0.2 pulls torch,
transformers and CUDA wheels, which this project does not otherwise need), it builds the token trie once per
tokenizer and computes masks lazily from an Earley parser, so even large schemas "compile" in
milliseconds, and it accepts JSON schema, regex, Lark and GBNF. vLLM and SGLang ship it as their
`guidance` backend.

`GrammarCompiler` owns the tokenizer view and a small thread pool. `submit(spec)` returns a
future of a compiled prototype `Matcher` (cached by the spec's key, so a schema that many
requests share compiles once); each sequence takes its own copy. The engine thread never
waits for a compile: a request waits, outside the scheduler, until its future is done.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Sequence

import numpy as np

from jaxserve.core.structured_outputs import StructuredOutputs

CACHE_SIZE = 512  # compiled specs kept (least recently used dropped first)


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile (invalid schema, regex or grammar)."""

    param = "structured_outputs"


def words(vocab_size: int) -> int:
    """int32 words of one row's packed bitmask: bit t % 32 of word t // 32 allows token t."""
    return -(-vocab_size // 32)


class Matcher:
    """One sequence's grammar state: the mask of the next token, and the tokens it accepts."""

    def __init__(self, matcher):
        self._m = matcher

    def copy(self) -> Matcher:
        return Matcher(self._m.deep_copy())

    def consume(self, token: int) -> bool:
        """Advances by `token`; False (and an error state) when the grammar rejects it."""
        return self._m.consume_token(int(token))

    @property
    def error(self) -> str:
        return self._m.get_error()

    @property
    def is_finished(self) -> bool:
        """The grammar has ended: no token but EOS can follow."""
        return self._m.is_stopped()


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer on a thread pool; thread-safe."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_ids: Sequence[int],
                 max_workers: int = 2):
        self.vocab_size = vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers,
                                                           thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, concurrent.futures.Future] = \
            collections.OrderedDict()
        # The token trie takes ~0.5 s to build: built on the pool too, the first compile waits.
        self._tokenizer = self._pool.submit(_tokenizer, tokenizer_json, vocab_size,
                                            sorted(eos_ids))
        self._executor = None  # llguidance's parallel mask filler, made on first use

    def submit(self, spec: StructuredOutputs) -> concurrent.futures.Future:
        """A future of the spec's prototype Matcher; its exception is a GrammarError."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception()):
                self._cache.move_to_end(key)
                return future
            future = self._cache[key] = self._pool.submit(self._compile, spec)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutputs, timeout: float | None = None) -> Matcher:
        """Waits for the spec's prototype (from any thread but the pool's); GrammarError."""
        return self.submit(spec).result(timeout)

    def _compile(self, spec: StructuredOutputs) -> Matcher:
        import llguidance as llg
        try:
            grammar = spec.grammar_text()
        except ValueError as e:
            raise GrammarError(f"invalid {spec.kind}: {e}") from None
        tok = self._tokenizer.result()
        error = llg.LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise GrammarError(f"invalid {spec.kind}: {error.strip()}")
        matcher = llg.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {matcher.get_error()}")
        if not _can_start(matcher, self.vocab_size):
            raise GrammarError(f"invalid {spec.kind}: no token of this model's vocabulary can "
                               f"start it")
        return Matcher(matcher)

    def fill(self, mask: np.ndarray, rows: Sequence[tuple[Matcher, int]]) -> None:
        """Writes each matcher's next-token bitmask into mask[row] (mask [R, W] int32, rows
        not listed are left alone), on llguidance's threads."""
        if not rows:
            return
        import llguidance as llg
        import llguidance.numpy as lnp
        if self._executor is None:
            self._executor = llg.LLExecutor()
        lnp.fill_next_token_bitmask_par(self._executor, [(m._m, r) for m, r in rows], mask)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# Above this many allowed first tokens the check below is skipped (one can surely be taken).
FIRST_TOKEN_CHECKS = 64


def _can_start(matcher, vocab_size: int) -> bool:
    """Whether some token can start the constraint. llguidance's first mask can allow a token
    it then rejects when the constraint needs bytes the vocabulary has no token for (seen
    with a small ASCII vocabulary and a regex of non-ASCII characters); such a request would
    fail at its first step, so it is refused with the compile instead."""
    import llguidance.numpy as lnp
    first = lnp.allocate_token_bitmask(1, vocab_size)  # [1, W] int32
    lnp.fill_next_token_bitmask(matcher, first)
    allowed = np.flatnonzero(np.unpackbits(first.view(np.uint8), bitorder="little")[:vocab_size])
    if allowed.size > FIRST_TOKEN_CHECKS:
        return True
    return any(matcher.deep_copy().consume_token(int(t)) for t in allowed)


def _tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
    import llguidance as llg
    return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_ids or None)
