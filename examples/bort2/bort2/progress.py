"""Progress bars that suit where stderr goes.

On a terminal, :func:`make_bar` is a tqdm bar (redrawn in place). When stderr is a file or a pipe
(``run.py ... 2> log``, a batch job, CI) a redrawn bar writes a carriage return and a whole bar
every ``mininterval``: 168 KB of them for the default run. There it prints instead one plain
line per ``every`` of the stage (10% by default) and one when the stage ends, e.g.::

    step2/bort2 [uci_m s0]: 30% (300/1000) 41 s loss=0.412
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

__all__ = ["LineBar", "make_bar"]


class LineBar:
    """The tqdm methods the pipeline uses (``update``, ``set_postfix``, ``write``, ``close``),
    printing one line each time progress crosses a multiple of ``every`` (a fraction of
    ``total``)."""

    def __init__(
        self,
        total: int,
        desc: str,
        initial: int = 0,
        every: float = 0.1,
        file: IO[str] | None = None,
    ):
        self.total, self.desc, self.n = int(total), desc, int(initial)
        self.file = file if file is not None else sys.stderr
        self.step = max(1, round(every * self.total)) if self.total > 0 else 1
        self.next = (self.n // self.step + 1) * self.step
        self.postfix = ""
        self.t0 = time.perf_counter()
        self.closed = False

    def set_postfix(self, **kwargs: Any) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in kwargs.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self.next and self.n < self.total:
            self._line()
            self.next = (self.n // self.step + 1) * self.step

    def _line(self) -> None:
        pct = f"{100 * self.n / self.total:.0f}% " if self.total > 0 else ""
        took = time.perf_counter() - self.t0
        tail = f" {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {pct}({self.n}/{self.total}) {took:.0f} s{tail}", file=self.file)
        self.file.flush()

    def write(self, text: str) -> None:
        """A message line (``tqdm.write``'s place: standard output)."""
        print(text, flush=True)

    def close(self) -> None:
        if not self.closed and self.n >= self.total > 0:
            self._line()  # the stage's last line: 100%
        self.closed = True

    def __enter__(self) -> LineBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Off:
    """A disabled bar."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, flush=True)  # messages still reach the user with the bar off

    def close(self) -> None:
        pass


def make_bar(
    total: int,
    desc: str,
    enabled: bool = True,
    initial: int = 0,
    every: float = 0.1,
    file: IO[str] | None = None,
) -> Any:
    """A progress bar over ``total`` steps starting at ``initial``.

    Disabled: a bar that prints nothing. ``file`` (default stderr) is a terminal: a tqdm bar,
    redrawn at most once a second and removed when done. Otherwise: a :class:`LineBar`, one
    line per ``every`` of ``total`` and one at the end.
    """
    if not enabled:
        return _Off()
    stream = file if file is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if not (callable(isatty) and isatty()):
        return LineBar(total, desc, initial=initial, every=every, file=stream)
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        leave=False,
        dynamic_ncols=True,
        mininterval=1.0,
        file=stream,
    )
