"""The start-up view (``backends/status_view.py``): a live table (``always``, or ``auto`` on a terminal), plain
lines otherwise (``never``), and the summary once a deployment is ready. Rendered on rich consoles that record
to a string."""

from __future__ import annotations

import io
import re
import time

from rich.console import Console

from miles_sglang_plugin.backends.status_view import StatusView, SummaryRow

ROUTER, ENGINE = "router.actor", "actor.regular.0"
#: name -> (kind, where), in the order the launcher tracks them.
TRACKED = {
    ROUTER: ("router", "http://127.0.0.1:20001"),
    ENGINE: ("engine", "http://127.0.0.1:20003 GPUs 0,1"),
}
#: What a launch goes through: the engine answers its health check, the router comes up, the engine is
#: registered, the router reports its workers.
TRANSITIONS = [(ENGINE, "healthy"), (ROUTER, "live"), (ENGINE, "registered"), (ROUTER, "ready")]


def recording_console() -> Console:
    return Console(file=io.StringIO(), record=True, width=120, highlight=False)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the rich tables in ``text``, as lists of cell texts."""
    return [
        [cell.strip() for cell in line.strip("│").split("│")] for line in text.splitlines() if "│" in line
    ]


def drawn(view: StatusView) -> str:
    """The live view as rich draws it now, from what the view gave it."""
    assert view._live is not None
    console = recording_console()
    console.print(view._live.renderable)
    return console.export_text()


def shown(view: StatusView) -> dict[str, tuple[str, str, str]]:
    """What the live table shows right now: name -> (kind, state, where)."""
    assert view._live is not None and view._live.is_started
    text = drawn(view)
    assert text.startswith("starting SGLang deployment (")
    return {name: (kind, state, where) for name, kind, state, _since, where in table_rows(text)}


def track_all(view: StatusView) -> None:
    for name, (kind, where) in TRACKED.items():
        view.track(name, kind, where)


def test_live_table_shows_each_state_transition() -> None:
    console = recording_console()
    view = StatusView(mode="always", console=console)
    assert view.live_mode
    track_all(view)
    states = {ROUTER: "starting", ENGINE: "starting"}
    assert shown(view) == {n: (k, states[n], w) for n, (k, w) in TRACKED.items()}
    for name, state in TRANSITIONS:
        view.update(name, state)
        states[name] = state
        assert shown(view) == {n: (k, states[n], w) for n, (k, w) in TRACKED.items()}, (name, state)
    view.update(ENGINE, "registered")  # the same state again: nothing changes
    assert shown(view)[ENGINE][1] == "registered"
    assert console.export_text(clear=False) == ""  # a live view prints no plain lines (and, off a terminal,
    view.finish()  # rich draws the table once, at the end)
    view.summary([SummaryRow("actor", "http://127.0.0.1:20001", "regular", 1, 2, "simulated")])
    text = console.export_text()
    final = text.split("SGLang deployment ready in", 1)[0]
    assert [(row[0], row[2]) for row in table_rows(final)] == [(ROUTER, "ready"), (ENGINE, "registered")]
    assert re.search(r"^SGLang deployment ready in \d+\.\d s", text, re.MULTILINE), (
        text
    )  # on a line of its own
    assert view._live is None


def test_plain_lines_without_live_view() -> None:
    for mode in ("auto",):  # auto: the recording console is not a terminal
        console = recording_console()
        view = StatusView(mode=mode, console=console)
        assert not view.live_mode
        track_all(view)
        for name, state in TRANSITIONS:
            view.update(name, state)
        view.update(ROUTER, "ready")  # unchanged: no line
        view.update("router.unknown", "ready")  # never tracked: ignored
        view.note("stand-in engines run side by side")
        view.finish()
        lines = console.export_text().splitlines()
        assert [re.sub(r"^\[ *\d+\.\d+s\] ", "", line) for line in lines] == [
            "engine actor.regular.0: healthy",
            "router router.actor: live",
            "engine actor.regular.0: registered",
            "router router.actor: ready",
            "note: stand-in engines run side by side",
        ], (mode, lines)
        assert all(re.match(r"^\[ *\d+\.\d+s\] ", line) for line in lines[:4])
        assert view._live is None


def test_never_prints_no_start_up_lines_only_notes() -> None:
    """live=never (issue 13): no live table and no plain lines of state changes; notes still print."""
    console = recording_console()
    view = StatusView(mode="never", console=console)
    track_all(view)
    for name, state in TRANSITIONS:
        view.update(name, state)
    view.note("stand-in engines run side by side")
    view.finish()
    assert console.export_text().splitlines() == ["note: stand-in engines run side by side"]
    assert view.rows[ENGINE].state == "registered" and view._live is None  # states are still tracked


def test_summary_prints_one_row_per_model() -> None:
    console = recording_console()
    view = StatusView(mode="never", console=console)
    view.summary(
        [
            SummaryRow("actor", "http://127.0.0.1:20001", "pd", 3, 12, "simulated"),
            SummaryRow("ref", "http://127.0.0.1:20041", "regular", 2, 4, "simulated"),
        ]
    )
    text = console.export_text()
    assert re.match(r"SGLang deployment ready in \d+\.\d s", text)
    assert table_rows(text) == [
        ["actor", "http://127.0.0.1:20001", "pd", "3", "12", "simulated"],
        ["ref", "http://127.0.0.1:20041", "regular", "2", "4", "simulated"],
    ]
    header = next(line for line in text.splitlines() if "┃" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")] == [
        "model", "router", "mode", "engines", "GPUs", "engine kind",
    ]  # fmt: skip


class FakeClock:
    """Seconds that move only when the test says so."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def title(view: StatusView) -> str:
    return drawn(view).splitlines()[0].rstrip()  # padded to the table's width


def test_the_live_tables_clock_goes_on_while_no_engine_changes_state() -> None:
    """A real engine loads its weights for minutes without a state change: the title's elapsed time must still
    move at each redraw (it stayed at 0.0 s when the view handed rich one table built at the start)."""
    clock = FakeClock(100.0)
    view = StatusView(mode="always", console=recording_console(), clock=clock)
    track_all(view)
    assert title(view) == "starting SGLang deployment (0.0 s)"
    clock.now = 112.5  # no update() in between
    assert title(view) == "starting SGLang deployment (12.5 s)"
    clock.now = 161.5
    assert title(view) == "starting SGLang deployment (61.5 s)"
    # The per-row column is when each row entered its state: unchanged until it changes.
    assert [row[3] for row in table_rows(drawn(view))] == ["0.0", "0.0"]
    view.update(ENGINE, "healthy")
    assert [row[3] for row in table_rows(drawn(view))] == ["0.0", "61.5"]
    view.finish()


def test_the_live_views_own_refresh_draws_the_later_time_on_a_terminal() -> None:
    """On a terminal rich redraws the view 4 times a second by itself; with the clock moved and nothing else
    done, a redraw shows the new elapsed time."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=120, highlight=False)
    clock = FakeClock(50.0)
    view = StatusView(mode="auto", console=console, clock=clock)
    assert view.live_mode
    track_all(view)
    clock.now = 57.5
    deadline = time.monotonic() + 30  # only ends a test whose redraw never comes
    while "starting SGLang deployment (7.5 s)" not in out.getvalue():
        assert time.monotonic() < deadline, out.getvalue()
        time.sleep(0.05)
    clock.now = 63.0
    view.finish()  # drawn a last time, as the clock says then
    assert out.getvalue().rsplit("starting SGLang deployment (", 1)[1].startswith("13.0 s)")
