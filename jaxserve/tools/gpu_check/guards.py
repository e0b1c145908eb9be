"""What keeps one call inside its limits whatever a section does: the stderr log (a tee that
keeps everything in the scratch folder and hides XLA's INFO lines from the terminal), the
per-section hard cap (SIGALRM raising SectionTimeout in the main thread), SIGTERM turned into
an exception (a `timeout` around the run still gets the bundle written), and the watchdog
thread that writes the report and the bundle and exits when the main thread is stuck past the
run's budget (inside a compile, where no Python-level check runs)."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import sys
import threading

HIDDEN = re.compile(rb"^I\d{4} ")  # glog INFO/VLOG lines: kept in the log, not on the terminal


class SectionTimeout(BaseException):
    """A section ran past its hard cap. BaseException: the per-case `except Exception` of the
    sections must not swallow it."""


class Terminated(BaseException):
    """SIGTERM arrived (e.g. from `timeout`): finish the report and the bundle, then exit."""


class StderrTee:
    """fd 2 into a pipe; a thread copies it to `path` and, less HIDDEN lines, to the terminal."""

    def __init__(self, path):
        self.path = path

    def start(self) -> "StderrTee":
        sys.stderr.flush()
        self.saved = os.dup(2)
        r, w = os.pipe()
        try:  # C++ code may write stderr holding the GIL the pump needs: a deep buffer
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
        except (AttributeError, OSError):
            pass
        os.dup2(w, 2)
        os.close(w)
        self.file = open(self.path, "ab")
        self.thread = threading.Thread(target=self._pump, args=(r,), daemon=True)
        self.thread.start()
        return self

    def _pump(self, r: int) -> None:
        pending = b""
        with os.fdopen(r, "rb", buffering=0) as src:
            while chunk := src.read(1 << 16):
                self.file.write(chunk)
                self.file.flush()
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                shown = b"".join(line + b"\n" for line in lines if not HIDDEN.match(line))
                if shown:
                    os.write(self.saved, shown)
        if pending and not HIDDEN.match(pending):
            os.write(self.saved, pending)

    def stop(self) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)  # the pipe's last writer closes: the thread reads to its end
        self.thread.join(timeout=5)
        self.file.close()


def raiser(exc):
    def handler(signum, frame):
        raise exc(f"signal {signum}")
    return handler


def arm_section(seconds: float | None) -> None:
    """SectionTimeout in the main thread after `seconds` (None: disarm)."""
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01) if seconds else 0)


def install_handlers() -> None:
    signal.signal(signal.SIGALRM, raiser(SectionTimeout))
    signal.signal(signal.SIGTERM, raiser(Terminated))


class Watchdog:
    """After `seconds`, unless finished first: `on_fire()` (write what there is), then exit.
    `finishing` is held by whoever writes the final report, so only one of them does."""

    def __init__(self, seconds: float, on_fire, exit_code: int = 3):
        self.finishing = threading.Lock()
        self.on_fire, self.exit_code = on_fire, exit_code
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def start(self) -> "Watchdog":
        self.timer.start()
        return self

    def _fire(self) -> None:
        if not self.finishing.acquire(blocking=False):
            return  # the main thread is writing the report already
        try:
            self.on_fire()
        finally:
            sys.stdout.flush()
            os._exit(self.exit_code)

    def cancel(self) -> bool:
        """True when the main thread may write the final report (the watchdog has not)."""
        self.timer.cancel()
        return self.finishing.acquire(blocking=False)
