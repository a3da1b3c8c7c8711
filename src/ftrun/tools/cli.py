"""`ftrun`: tools around the launcher. `ftrun report LOG_DIR` explains what a job went through;
`ftrun status` shows where a job stands now; `ftrun straggler LOG_DIR ...` retunes a running
job's straggler detection; `ftrun store --port P` serves a job's rendezvous store off the agents.

Errors a person can fix (a wrong directory, files that are not events) end with one line on
stderr and exit status 2, never a traceback: this runs after a bad night, on a bad log. The
picture needs matplotlib (`pip install 'ftrun[report]'`); without it the summary still prints,
with a line saying how to get the picture, and the command succeeds.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import NoReturn

import click

from ftrun.config.straggler import StragglerAction, StragglerConfig, write_control
from ftrun.errors import ConfigError
from ftrun.eventlog.job_status import status_table
from ftrun.eventlog.reader import ReportInputError, load_events
from ftrun.eventlog.report import build_report
from ftrun.tools.status_sources import StatusInputError, from_endpoint, from_log_dir
from ftrun.tools.stragglers import scores_picture
from ftrun.tools.summary import to_json, to_text

EXIT_BAD_INPUT = 2
EXIT_NO_TIMELINE = 1
"""The timeline could not be written where asked (matplotlib missing is not an error)."""
CLEAR_SCREEN = "\x1b[H\x1b[2J"
NO_MATPLOTLIB = "not drawn: matplotlib is not installed (pip install 'ftrun[report]')"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Tools for jobs run by ft_launcher."""


@main.command()
@click.argument("log_dir", type=click.Path(path_type=Path, file_okay=True, dir_okay=True))
@click.option(
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Timeline PNG to write [default: LOG_DIR/timeline.png].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--no-timeline", is_flag=True, help="Do not draw the timeline PNG.")
def report(log_dir: Path, out: Path | None, as_json: bool, no_timeline: bool) -> None:
    """Summarise a job from the events files in LOG_DIR (ft_launcher --log-dir)."""
    try:
        events = load_events(log_dir)
    except ReportInputError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    for warning in events.warnings:  # also in the report; stderr so `--json | jq` sees them
        click.echo(f"ftrun report: warning: {warning}", err=True)
    result = build_report(events)
    timeline: str | None = None
    note: str | None = None
    error: str | None = None
    if not no_timeline:
        target = out or log_dir / "timeline.png"
        try:
            from ftrun.tools.timeline import draw_timeline  # matplotlib: optional, slow import
        except ImportError:  # the summary is still worth printing, and says how to get this
            note = NO_MATPLOTLIB
        else:
            try:
                draw_timeline(result, target)
                timeline = str(target)
            except OSError as exc:
                error = f"cannot write the timeline {target}: {exc.strerror or exc}"
    if as_json:
        click.echo(to_json(result, timeline, note), nl=False)
        if note:  # stdout is for machines; a person still learns how to get the picture
            click.echo(f"ftrun report: timeline {note}", err=True)
    else:
        click.echo(to_text(result, timeline, note), nl=False)
        click.echo(scores_picture(events), nl=False)
    if error:
        _fail(error, EXIT_NO_TIMELINE)


@main.command()
@click.argument("log_dir", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option("--on/--off", "enabled", default=None, help="Start or stop the detection.")
@click.option("--interval", type=float, help="Seconds between reports.")
@click.option("--action", type=click.Choice([a.value for a in StragglerAction]))
@click.option(
    "--threshold",
    "thresholds",
    multiple=True,
    metavar="KIND=X",
    help="KIND: gpu_relative, gpu_individual, section_relative or section_individual.",
)
def straggler(
    log_dir: Path,
    enabled: bool | None,
    interval: float | None,
    action: str | None,
    thresholds: tuple[str, ...],
) -> None:
    """Change the straggler detection of the job logging to LOG_DIR while it runs (every agent
    reads LOG_DIR/straggler.json within one report interval)."""
    given = {"enabled": enabled, "report_interval": interval, "action": action}
    overrides: dict[str, object] = {key: value for key, value in given.items() if value is not None}
    for item in thresholds:
        kind, _, value = item.partition("=")
        try:
            overrides[f"{kind}_threshold"] = float(value)
        except ValueError:
            _fail(f"--threshold {item}: expected KIND=NUMBER", EXIT_BAD_INPUT)
    try:
        path = write_control(log_dir, overrides, StragglerConfig())
    except (ConfigError, OSError) as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    click.echo(f"{path}: {path.read_text(encoding='utf-8').strip()}")


@main.command()
@click.option(
    "--log-dir",
    type=click.Path(path_type=Path),
    help="The job's --log-dir: the status from its events files.",
)
@click.option(
    "--endpoint",
    metavar="HOST:PORT",
    help="A live status page (ft_launcher --ft-status-port): its /status.json.",
)
@click.option(
    "--watch",
    type=float,
    is_flag=False,
    flag_value=2.0,
    metavar="[SECONDS]",
    help="Refresh every SECONDS (2 without a value) until Ctrl-C.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the status document as JSON.")
def status(log_dir: Path | None, endpoint: str | None, watch: float | None, as_json: bool) -> None:
    """The job's status now: nodes and their state, ranks stepping, cycle, time lost, the last
    failures, stragglers and checkpoints."""
    if (log_dir is None) == (endpoint is None):
        _fail("give one of --log-dir DIR or --endpoint HOST:PORT", EXIT_BAD_INPUT, "status")
    if watch is not None and watch <= 0:
        _fail("--watch: SECONDS must be positive", EXIT_BAD_INPUT, "status")
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends --watch
        while True:
            try:
                doc = from_log_dir(log_dir) if log_dir else from_endpoint(str(endpoint))
                text = json.dumps(doc, indent=1) + "\n" if as_json else status_table(doc)
            except StatusInputError as exc:
                if watch is None:
                    _fail(str(exc), EXIT_BAD_INPUT, "status")
                text = f"ftrun status: {exc} (trying again every {watch:g} s)\n"  # page moving
            if watch is None:
                click.echo(text, nl=False)
                return
            click.echo(CLEAR_SCREEN + text, nl=False)
            time.sleep(watch)


@main.command()
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    required=True,
    help="The port of ft_launcher's --rdzv-endpoint HOST:PORT.",
)
def store(port: int) -> None:
    """Serve a job's rendezvous store (a c10d TCPStore) as its own process, until SIGTERM,
    SIGINT or SIGHUP. The job's launchers run with --ft-store-reconnect-timeout: none of them
    serves it, and they come through a restart of this process. Exit 1: the port cannot be
    served."""
    from ftrun.tools.store_server import StoreServeError, serve_until_signalled  # torch

    try:
        received = serve_until_signalled(port)
    except StoreServeError as exc:
        _fail(f"cannot serve port {port}: {exc}", 1, "store")
    click.echo(f"ftrun store: stopped by {received.name}")


def _fail(message: str, code: int, command: str = "report") -> NoReturn:
    click.echo(f"ftrun {command}: error: {message}", err=True)
    sys.exit(code)


if __name__ == "__main__":
    main(prog_name="ftrun")
