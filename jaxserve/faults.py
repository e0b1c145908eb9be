"""Fault injection for tests: make the engine fail on purpose, in the ways real failures look.

Off by default. `EngineConfig(faults="...")` or the environment variable `JAXSERVE_FAULTS`
(read once, when the engine starts) holds a spec of `key=value` pairs separated by commas, e.g.
`JAXSERVE_FAULTS="nan_request=#2,nan_value=inf"`. Keys (FaultConfig's fields):

- `step_raise=N`: the engine's N-th `step()` call (0-based) raises InjectedFault.
- `step_stall=N`, `stall_s=S`: the N-th step sleeps S seconds first (a hung device call).
- `thread_die=N`: the N-th step raises EngineThreadDeath, which the server's engine loop does
  not handle: its thread ends without cleaning up, as if it had been killed.
- `nan_request=R`, `nan_at=K`, `nan_value=nan|inf`: request R's row of logits is poisoned on
  the device, before the sampler, in the K-th step in which it samples (0-based).
- `detokenizer_request=R`: request R's detokenizer raises on its first token.
- `grammar_request=R`: request R's grammar matcher raises on its first token.

A request R is named by its id, or as `#K`: the K-th request added to the engine (1-based).
No jax here: EngineConfig validates the spec before jax starts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import typing
from typing import Literal

ENV_VAR = "JAXSERVE_FAULTS"
log = logging.getLogger("jaxserve")
NanValue = Literal["nan", "inf"]


class InjectedFault(RuntimeError):
    """Raised where a FaultConfig says so."""


class EngineThreadDeath(BaseException):
    """An injected death of the engine thread: not an Exception, so no handler catches it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultConfig:
    step_raise: int | None = None
    step_stall: int | None = None
    stall_s: float = 30.0
    thread_die: int | None = None
    nan_request: str | None = None
    nan_at: int = 0
    nan_value: NanValue = "nan"
    detokenizer_request: str | None = None
    grammar_request: str | None = None

    def __post_init__(self):
        for name in ("step_raise", "step_stall", "thread_die", "nan_at"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"faults: {name} must be an integer >= 0, got {value!r}")
        if isinstance(self.stall_s, bool) or not isinstance(self.stall_s, (int, float)) \
                or not self.stall_s > 0:
            raise ValueError(f"faults: stall_s must be a positive number, got {self.stall_s!r}")
        if self.nan_value not in typing.get_args(NanValue):
            raise ValueError(f"faults: nan_value must be one of {typing.get_args(NanValue)}, "
                             f"got {self.nan_value!r}")
        for name in ("nan_request", "detokenizer_request", "grammar_request"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"faults: {name} must be a request id or '#K', got {value!r}")

    @property
    def poisons_logits(self) -> bool:
        """Whether the step programs need the poison input (compiled only then)."""
        return self.nan_request is not None

    @classmethod
    def parse(cls, spec: str | None) -> FaultConfig | None:
        """`key=value,...` -> FaultConfig; None or an empty spec -> None (no faults)."""
        if spec is None or not spec.strip():
            return None
        kinds = typing.get_type_hints(cls)
        kwargs = {}
        for part in spec.split(","):
            key, sep, raw = part.strip().partition("=")
            if not sep or key not in kinds:
                raise ValueError(f"faults: {part.strip()[:40]!r} is not key=value with a key "
                                 f"among {sorted(kinds)}")
            kwargs[key] = _value(key, raw.strip(), kinds[key])
        return cls(**kwargs)


def _value(key: str, raw: str, kind):
    if kind in (int, int | None):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"faults: {key} must be an integer, got {raw[:40]!r}") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"faults: {key} must be a number, got {raw[:40]!r}") from None
    return raw


class _RaisingDetokenizer:
    """Stands in for a request's detokenizer; raises where the real one would decode."""

    def __init__(self, inner):
        self._inner = inner

    def add(self, token: int) -> str:
        raise InjectedFault(f"injected detokenizer fault (token {token})")

    def flush(self) -> str:
        return self._inner.flush() if self._inner is not None else ""


class _RaisingMatcher:
    """Wraps a grammar Matcher (everything else is passed through); consume raises."""

    def __init__(self, inner):
        self._inner = inner

    def consume(self, token: int) -> bool:
        raise InjectedFault(f"injected grammar fault (token {token})")

    def __getattr__(self, name):
        return getattr(self._inner, name)


def injector(spec: str | None) -> FaultInjector | None:
    """The engine's injector: `spec` (EngineConfig.faults), else $JAXSERVE_FAULTS, read once
    when the engine starts; None when neither asks for a fault."""
    faults = FaultConfig.parse(spec if spec is not None else os.environ.get(ENV_VAR))
    if faults is None:
        return None
    log.warning("fault injection is on: %s", faults)
    return FaultInjector(faults)


class FaultInjector:
    """The engine's view of a FaultConfig: asked at each step and for each request."""

    def __init__(self, config: FaultConfig):
        self.config = config
        self._num_added = 0
        self._ids: dict[str, str] = {}  # '#K' targets -> the request id they resolved to
        self._samples: dict[str, int] = {}  # nan_request's sequence ids -> steps sampled

    def _is(self, target: str | None, request_id: str) -> bool:
        return target is not None and self._ids.get(target, target) == request_id

    def on_request(self, state) -> None:
        """A request was added (`state`: its request state): counted for '#K' targets; the
        detokenizer fault's target decodes through a raising stand-in."""
        self._num_added += 1
        self._ids.setdefault(f"#{self._num_added}", state.request_id)
        if self._is(self.config.detokenizer_request, state.request_id):
            for branch in getattr(state, "branches", ()):
                branch.detok = _RaisingDetokenizer(branch.detok)

    def on_grammar(self, state) -> None:
        """A constrained request's grammar compiled (start_grammar): the grammar fault's
        target matches through a raising stand-in."""
        if self._is(self.config.grammar_request, state.request_id):
            for branch in state.branches:
                if branch.matcher is not None:
                    branch.matcher = _RaisingMatcher(branch.matcher)

    def before_step(self, step_num: int) -> None:
        c = self.config
        if c.step_stall == step_num:
            time.sleep(c.stall_s)
        if c.step_raise == step_num:
            raise InjectedFault(f"injected step fault (step {step_num})")
        if c.thread_die == step_num:
            raise EngineThreadDeath(f"injected engine thread death (step {step_num})")

    def poison(self, rows, owner) -> dict[str, float] | None:
        """rows: the step's scheduled rows (core/scheduler.py ScheduledSeq); owner: sequence
        id -> request state. Returns sequence id -> the value added to its row of logits (rows
        not listed get 0), or None when no fault poisons logits."""
        c, found = self.config, {}
        if not c.poisons_logits:
            return None
        for item in rows:
            if not item.is_last_chunk:
                continue
            sid = item.request_id
            if not self._is(c.nan_request, owner[sid].request_id):
                continue
            k = self._samples.get(sid, 0)
            self._samples[sid] = k + 1
            if k == c.nan_at:
                found[sid] = math.nan if c.nan_value == "nan" else math.inf
        return found
