"""Progress and the final summary of a tuning run, behind one small interface.

The engine only calls a :class:`Reporter` (``stage``, ``progress``,
``warning``, ``summary``); what the user sees is chosen by the command:

* :class:`RichReporter`: a live rich progress line per stage (segment,
  candidates done / planned, best so far, elapsed, ETA) and a summary table.
* :class:`JsonReporter`: one JSON object per event on a stream (``--json``).
* :class:`QuietReporter`: nothing but warnings (``--quiet``).
* :class:`RecordingReporter`: keeps the events (tests).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TextIO

from rich import progress as rich_progress
from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Progress:
    """One step of a stage.

    ``done`` / ``planned``: candidates (stage 2) or moves (stage 1) so far and
    expected in all (``planned`` may grow). ``best_ms``: the best time so far
    (stage 1: the chain's sampled cost; stage 2: this segment's best).
    ``eta_s``: estimated seconds left, None when unknown.
    """

    stage: str
    segment: str
    done: int
    planned: int
    best_ms: float | None
    elapsed_s: float
    eta_s: float | None


@dataclass(frozen=True)
class SummaryRow:
    """One tuned segment: the analytical default vs the tuned config."""

    segment: str
    family: str
    occurrences: int
    default_ms: float | None
    tuned_ms: float | None
    config: str
    source: str  # "measured" | "database"

    @property
    def speedup(self) -> float | None:
        if self.default_ms is None or self.tuned_ms is None or self.tuned_ms <= 0:
            return None
        return self.default_ms / self.tuned_ms


class Reporter(Protocol):
    """What the engine tells the user. Implementations must not raise."""

    def stage(self, name: str, message: str) -> None: ...

    def progress(self, event: Progress) -> None: ...

    def warning(self, message: str) -> None: ...

    def summary(self, rows: list[SummaryRow]) -> None: ...


class RecordingReporter:
    """Keeps every event in ``events`` as ``(kind, payload)`` (for tests)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def stage(self, name: str, message: str) -> None:
        self.events.append(("stage", (name, message)))

    def progress(self, event: Progress) -> None:
        self.events.append(("progress", event))

    def warning(self, message: str) -> None:
        self.events.append(("warning", message))

    def summary(self, rows: list[SummaryRow]) -> None:
        self.events.append(("summary", rows))

    def of_kind(self, kind: str) -> list[Any]:
        return [payload for k, payload in self.events if k == kind]


class QuietReporter:
    """Prints warnings to stderr and nothing else."""

    def __init__(self, err: TextIO | None = None) -> None:
        self.err = err

    def stage(self, name: str, message: str) -> None:
        pass

    def progress(self, event: Progress) -> None:
        pass

    def warning(self, message: str) -> None:
        print(f"warning: {message}", file=self.err or sys.stderr)

    def summary(self, rows: list[SummaryRow]) -> None:
        pass


class JsonReporter:
    """One JSON object per line: ``{"event": "progress", ...}`` (machine-readable)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out

    def _emit(self, payload: dict[str, Any]) -> None:
        stream = self.out or sys.stdout
        stream.write(json.dumps(payload, sort_keys=True) + "\n")
        stream.flush()

    def stage(self, name: str, message: str) -> None:
        self._emit({"event": "stage", "stage": name, "message": message})

    def progress(self, event: Progress) -> None:
        self._emit({"event": "progress", **asdict(event)})

    def warning(self, message: str) -> None:
        self._emit({"event": "warning", "message": message})

    def summary(self, rows: list[SummaryRow]) -> None:
        self._emit({"event": "summary",
                    "segments": [{**asdict(r), "speedup": r.speedup} for r in rows]})


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value:.0f}s" if value >= 10 else f"{value:.1f}s"


class RichReporter:
    """A live progress line (rich) per stage and a summary table at the end."""

    def __init__(self, console: Any = None) -> None:
        self.console = console or Console(stderr=True)
        self._progress: Any = None
        self._task: Any = None

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def stage(self, name: str, message: str) -> None:
        self._stop()
        self.console.print(f"[bold]{name}[/]: {message}")
        rp = rich_progress
        self._progress = rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(),
                                     rp.MofNCompleteColumn(), rp.TextColumn("{task.fields[info]}"),
                                     console=self.console, transient=True)
        self._task = self._progress.add_task(name, total=None, info="")
        self._progress.start()

    def progress(self, event: Progress) -> None:
        if self._progress is None:
            return
        info = (f"best {_fmt_ms(event.best_ms)} ms  elapsed {_fmt_s(event.elapsed_s)}  "
                f"eta {_fmt_s(event.eta_s)}")
        self._progress.update(self._task, description=f"{event.stage} {event.segment}",
                              completed=event.done, total=max(event.planned, event.done),
                              info=info)

    def warning(self, message: str) -> None:
        self.console.print(f"[yellow]warning:[/] {message}")

    def summary(self, rows: list[SummaryRow]) -> None:
        self._stop()
        table = Table(title="tuning summary")
        for column in ("segment", "family", "x", "default ms", "tuned ms", "speed-up", "source"):
            table.add_column(column, justify="right" if column not in ("segment", "family")
                             else "left")
        for row in rows:
            speedup = row.speedup
            table.add_row(row.segment, row.family, str(row.occurrences), _fmt_ms(row.default_ms),
                          _fmt_ms(row.tuned_ms), "-" if speedup is None else f"{speedup:.2f}x",
                          row.source)
        self.console.print(table)
