"""A transient progress display for `rewrite` runs that take a while (rich, on stderr).

Shown only when stderr is a terminal, and only once the run has taken AFTER_S seconds: a quick
run prints nothing more than before, a pipe or a log file never gets it, and it never goes to
stdout (where `--diff` writes). It is erased (transient) whenever a file's work ends, before
that file's diff and report are printed, so it never interleaves with them.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

AFTER_S = 1.0  # a run shorter than this shows no progress


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


class DelayedProgress:
    """Progress over `total` files, drawn on `stderr_console()` once `after` seconds of the run
    have passed while a file is being worked on (a timer thread starts the display)."""

    def __init__(self, total: int, enabled: bool, after: Optional[float] = None):
        self.total = total
        self.enabled = enabled
        self.after = AFTER_S if after is None else after
        self.started = time.monotonic()
        self.done = 0
        self._lock = threading.Lock()
        self._shown = None  # the rich Progress while it is on screen

    @contextmanager
    def working(self, label: str) -> Iterator[None]:
        """The work on one file: the display is up (once due) until it ends."""
        if not self.enabled:
            yield
            return
        over = threading.Event()
        delay = max(0.0, self.after - (time.monotonic() - self.started))
        timer = threading.Timer(delay, self._show, (label, over))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            with self._lock:
                over.set()
                self.done += 1
                if self._shown is not None:
                    self._shown.stop()  # transient: erased from the terminal
                    self._shown = None

    def _show(self, label: str, over: threading.Event) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

        with self._lock:
            if over.is_set():
                return
            progress = Progress(
                SpinnerColumn(), TextColumn("rewriting {task.description}"), BarColumn(), MofNCompleteColumn(),
                transient=True, console=stderr_console(),
                redirect_stdout=False, redirect_stderr=False,
            )
            progress.add_task(label, total=self.total, completed=self.done)
            progress.start()
            self._shown = progress
