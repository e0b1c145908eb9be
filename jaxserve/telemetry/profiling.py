"""jax.profiler captures of engine steps, for Perfetto (ui.perfetto.dev) or TensorBoard.

A capture writes `DIR/plugins/profile/<timestamp>/` with `<host>.xplane.pb` (TensorBoard /
xprof) and `perfetto_trace.json.gz` (Perfetto). Inside, the host timeline shows each
`engine_step` with its `schedule` / `execute` / `postprocess` parts, and the compiled step's ops
carry name-scope paths: `prefill` or `decode` and `sampling` (runner.py), `attention` around
the attention kernel (models/llama.py), and Flax's module names (`layers/attn`, `layers/mlp`).
On a GPU they label the kernels; on the CPU they sit in the HLO metadata of the trace (XLA:CPU
names its thunks after fused HLO ops).

jax allows one capture per process; a Profiler owns at most one and refuses a second.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import warnings

import jax

log = logging.getLogger("jaxserve")

STAGE_SCOPES = ("prefill", "decode", "attention", "mlp", "sampling")


class ProfilerError(RuntimeError):
    """A capture cannot start or stop (none configured, one running, none running)."""


class Profiler:
    """Starts and stops captures; `on_step` ends one after a requested number of steps.

    Thread-safe: the server's HTTP threads start and stop captures while the engine thread steps.
    """

    def __init__(self, directory: str | pathlib.Path | None = None):
        self.directory = None if directory is None else pathlib.Path(directory)
        self._lock = threading.Lock()
        self._active: pathlib.Path | None = None
        self._steps_left: int | None = None
        self.captures: list[pathlib.Path] = []  # finished captures' run directories

    @property
    def active(self) -> bool:
        return self._active is not None

    def start(self, directory: str | pathlib.Path | None = None,
              num_steps: int | None = None) -> pathlib.Path:
        """Starts a capture into `directory` (default: the configured one).

        With `num_steps`, the capture stops itself after that many engine steps.
        """
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(
                num_steps, int) or num_steps < 1):
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        with self._lock:
            target = pathlib.Path(directory) if directory is not None else self.directory
            if target is None:
                raise ProfilerError("profiling is off: no profile directory was configured "
                                    "(start with --profile-dir DIR)")
            if self._active is not None:
                raise ProfilerError(f"a capture into {self._active} is already running; "
                                    "stop it first")
            target.mkdir(parents=True, exist_ok=True)
            try:
                jax.profiler.start_trace(str(target), create_perfetto_trace=True)
            except RuntimeError as e:  # another capture in this process (not ours)
                raise ProfilerError(f"jax.profiler could not start: {e}") from e
            self._active, self._steps_left = target, num_steps
            log.info("profiling into %s%s", target,
                     f" for {num_steps} steps" if num_steps else "")
            return target

    def stop(self) -> pathlib.Path:
        """Stops the capture; returns its run directory (holding the .xplane.pb)."""
        with self._lock:
            return self._stop_locked()

    def _stop_locked(self) -> pathlib.Path:
        if self._active is None:
            raise ProfilerError("no capture is running")
        target, self._active, self._steps_left = self._active, None, None
        before = set(self.captures)
        jax.profiler.stop_trace()
        runs = sorted((target / "plugins" / "profile").glob("*"), key=lambda p: p.stat().st_mtime)
        run = next((r for r in reversed(runs) if r not in before), target)
        self.captures.append(run)
        log.info("profile written to %s", run)
        return run

    def on_step(self) -> pathlib.Path | None:
        """Called after each engine step; stops a step-limited capture at its last step."""
        if self._steps_left is None:  # fast path without the lock: nothing step-limited
            return None
        with self._lock:
            if self._steps_left is None:
                return None
            self._steps_left -= 1
            if self._steps_left > 0:
                return None
            return self._stop_locked()


def scope_device_seconds(run_dir: str | pathlib.Path, scope: str) -> float | None:
    """Seconds of device-timeline events whose op path contains `/scope/`, summed over a capture.

    GPU traces give each kernel event its op's name-scope path (e.g.
    `jit(_step_impl)/decode/attention/...`) as a stat; CPU traces have no device plane, so the
    answer there is None.
    """
    from jax.profiler import ProfileData
    needle, total, found = f"/{scope}/", 0, False
    with warnings.catch_warnings():  # jaxlib's nanobind stats type warns on iteration
        warnings.simplefilter("ignore", DeprecationWarning)
        for xplane in pathlib.Path(run_dir).glob("*.xplane.pb"):
            for plane in ProfileData.from_file(str(xplane)).planes:
                if not plane.name.startswith("/device:"):
                    continue
                found = True
                for line in plane.lines:
                    for event in line.events:
                        texts = [event.name, *(v for _, v in event.stats if isinstance(v, str))]
                        if any(needle in t for t in texts):
                            total += event.duration_ns
    return total / 1e9 if found else None
