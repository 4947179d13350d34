"""What a person sees while a deployment starts: a live table on a terminal, plain lines otherwise, and a
summary (model, router URL, engines, GPUs) once it is ready."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from miles_sglang_plugin.printable import escape_controls

_STYLE = {"starting": "yellow", "catching_up": "cyan", "serving": "green", "live": "cyan", "ready": "green",
          "failed": "bold red"}  # fmt: skip


@dataclass(frozen=True)
class SummaryRow:
    """One model of a deployment that is ready."""

    model: str
    router: str
    mode: str
    engines: int
    gpus: int
    engine_kind: str


@dataclass
class _Row:
    kind: str
    detail: str
    since: float
    state: str = "starting"


class _FreshTable:
    """What the live view is given: each time rich draws it (on its refresh timer, 4 times a second, and once
    more when it stops) it builds the table anew, so the elapsed time in its title goes on while no engine
    changes state (a real engine loading its weights for minutes)."""

    def __init__(self, view: StatusView) -> None:
        self.view = view

    def __rich__(self) -> RenderableType:
        return self.view._table()


class StatusView:
    """``mode``: ``auto`` (a live table on a terminal, plain lines of state changes otherwise), ``always`` (the
    live table) or ``never`` (no start-up display: only notes and the summary once ready). ``clock``: the
    seconds the times shown are taken from (a test's own clock)."""

    def __init__(
        self, mode: str = "auto", console: Console | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.live_mode = mode == "always" or (mode == "auto" and self.console.is_terminal)
        self.quiet = mode == "never"
        self.clock = clock
        self.rows: dict[str, _Row] = {}
        self.started_at = clock()
        self._live: Live | None = None
        # The rows change on the launcher's and the reconcile loop's threads and are drawn on rich's refresh
        # thread.
        self._rows_lock = threading.Lock()

    def _table(self) -> Table:
        table = Table(
            title=f"starting SGLang deployment ({self.clock() - self.started_at:.1f} s)",
            title_justify="left",
        )
        for col in ("name", "kind", "state", "s", "where"):
            table.add_column(col)
        with self._rows_lock:
            rows = [(name, row.kind, row.detail, row.state, row.since) for name, row in self.rows.items()]
        for name, kind_text, detail_text, state_text, since in rows:
            state = Text(state_text, style=_STYLE.get(state_text, ""))  # any state name, styled or not
            name_cell, kind, detail = (Text(escape_controls(text)) for text in (name, kind_text, detail_text))
            table.add_row(name_cell, kind, state, f"{since - self.started_at:.1f}", detail)
        return table

    def track(self, name: str, kind: str, detail: str) -> None:
        with self._rows_lock:
            self.rows[name] = _Row(kind=kind, detail=detail, since=self.clock())
        if self.live_mode and self._live is None:
            self._live = Live(_FreshTable(self), console=self.console, refresh_per_second=4, transient=False)
            self._live.start()

    def update(self, name: str, state: str) -> None:
        with self._rows_lock:
            row = self.rows.get(name)
            if row is None or row.state == state:
                return
            row.state, row.since = state, self.clock()
            since, kind = row.since, row.kind
        if not self.live_mode and not self.quiet:  # the live table shows it at its next refresh
            self.console.print(
                escape_controls(f"[{since - self.started_at:6.1f}s] {kind} {name}: {state}"),
                markup=False,
            )

    def note(self, text: str) -> None:
        self.console.print(f"note: {escape_controls(text, keep_newlines=True)}", markup=False)

    def finish(self) -> None:
        if self._live is not None:
            self._live.stop()  # drawn a last time
            self._live = None
            if not self.console.is_terminal:  # rich ends the table's last line only on a terminal
                self.console.line()

    def summary(self, rows: Iterable[SummaryRow]) -> None:
        table = Table(
            title=f"SGLang deployment ready in {self.clock() - self.started_at:.1f} s",
            title_justify="left",
        )
        for col in ("model", "router", "mode", "engines", "GPUs", "engine kind"):
            table.add_column(col)
        for row in rows:
            cells = (row.model, row.router, row.mode, str(row.engines), str(row.gpus), row.engine_kind)
            table.add_row(*(Text(escape_controls(cell)) for cell in cells))
        self.console.print(table)
