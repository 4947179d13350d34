"""What a person sees while a deployment starts: a live table on a terminal, plain lines otherwise, and a
summary (model, router URL, engines, GPUs) once it is ready."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from rich.console import Console
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
    state: str = "starting"
    since: float = field(default_factory=time.monotonic)


class StatusView:
    """``mode``: ``auto`` (a live table on a terminal, plain lines of state changes otherwise), ``always`` (the
    live table) or ``never`` (no start-up display: only notes and the summary once ready)."""

    def __init__(self, mode: str = "auto", console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.live_mode = mode == "always" or (mode == "auto" and self.console.is_terminal)
        self.quiet = mode == "never"
        self.rows: dict[str, _Row] = {}
        self.started_at = time.monotonic()
        self._live: Live | None = None

    def _table(self) -> Table:
        table = Table(
            title=f"starting SGLang deployment ({time.monotonic() - self.started_at:.1f} s)",
            title_justify="left",
        )
        for col in ("name", "kind", "state", "s", "where"):
            table.add_column(col)
        for name, row in self.rows.items():
            state = Text(row.state, style=_STYLE.get(row.state, ""))  # any state name, styled or not
            name_cell, kind, detail = (Text(escape_controls(text)) for text in (name, row.kind, row.detail))
            table.add_row(name_cell, kind, state, f"{row.since - self.started_at:.1f}", detail)
        return table

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._table())

    def track(self, name: str, kind: str, detail: str) -> None:
        self.rows[name] = _Row(kind=kind, detail=detail)
        if self.live_mode and self._live is None:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self._live.start()
        self._refresh()

    def update(self, name: str, state: str) -> None:
        row = self.rows.get(name)
        if row is None or row.state == state:
            return
        row.state, row.since = state, time.monotonic()
        if self.live_mode:
            self._refresh()
        elif not self.quiet:
            self.console.print(
                escape_controls(f"[{row.since - self.started_at:6.1f}s] {row.kind} {name}: {state}"),
                markup=False,
            )

    def note(self, text: str) -> None:
        self.console.print(f"note: {escape_controls(text, keep_newlines=True)}", markup=False)

    def finish(self) -> None:
        if self._live is not None:
            self._refresh()
            self._live.stop()
            self._live = None
            if not self.console.is_terminal:  # rich ends the table's last line only on a terminal
                self.console.line()

    def summary(self, rows: Iterable[SummaryRow]) -> None:
        table = Table(
            title=f"SGLang deployment ready in {time.monotonic() - self.started_at:.1f} s",
            title_justify="left",
        )
        for col in ("model", "router", "mode", "engines", "GPUs", "engine kind"):
            table.add_column(col)
        for row in rows:
            cells = (row.model, row.router, row.mode, str(row.engines), str(row.gpus), row.engine_kind)
            table.add_row(*(Text(escape_controls(cell)) for cell in cells))
        self.console.print(table)
