"""The status page (`--ft-status-port`) in a real headless browser, through a failure.

2 nodes x 2 ranks of tests/workers/fault_worker.py; chromium loads the page from group rank 0's
agent and the test reads only what the page's script rendered: both nodes stepping, then (after
one rank of group rank 1 is SIGKILLed) that node's row leaving `stepping` or counting a
restart, then both stepping again in cycle 1 with the crash in "Last failures". The page is
read-only: other methods than GET/HEAD are refused and change nothing. The full-page screenshot
is saved as <tmp_path>/status-page.png (docs/status-page.png is one of these).

Needs playwright (python) and a chromium binary: $FTRUN_CHROMIUM, /usr/bin/chromium or
/usr/bin/chromium-browser (`make test` runs tests/browser/install-chromium.sh first); skipped,
saying which is missing, without them.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from launch import Job, free_port, start_job
from support import wait_for

try:
    from playwright import sync_api
except ImportError as exc:  # not installed, or broken (a missing driver): skip, saying why
    pytest.skip(f"playwright is not importable: {exc!r}", allow_module_level=True)

pytestmark = pytest.mark.process

FAULT = Path(__file__).resolve().parent / "workers" / "fault_worker.py"
LIGHT_ARGS = (
    "--max-restarts=2",
    "--workers-stop-timeout=1",
    "--ft-rank-heartbeat-timeout=1",
    "--ft-prewarm-modules=ftrun.client_lib",
)
# Cycle 0 outlasts the test's waits (it is cut short by the kill); cycle 1 is long enough for
# the page (polling every 2 s) to show both nodes stepping in it, then the job ends by itself.
STEPS = ("--first-cycle-steps", "400", "--steps", "140", "--step-time", "0.05")
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHANGES = ("failure", "hang", "stop_done", "restart", "exit")
VIEWPORT = {"width": 1280, "height": 800}
STATE, RESTARTS = 2, 8  # cells of a #nodes row: node, group rank, state, ..., restarts, ...

# Both nodes' rows show `state`; with `cycle`, #cycle shows it and "Last failures" has a row.
ALL_IN_STATE = """([names, state, cycle]) =>
  names.every(n => {
    const row = document.getElementById("node-" + n);
    return row !== null && row.cells[2].textContent === state;
  }) && (cycle === null || (document.getElementById("cycle").textContent === String(cycle)
         && document.querySelectorAll("#failures tbody tr").length > 0))"""
# The victim's row shows another state than stepping, or a restart.
VICTIM_MOVED = """(name) => {
  const row = document.getElementById("node-" + name);
  return row !== null && (row.cells[2].textContent !== "stepping"
                          || row.cells[8].textContent === "1");
}"""


def chromium() -> str:
    candidates = [os.environ.get("FTRUN_CHROMIUM", ""), *CHROMIUM_PATHS]
    found = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if found is None:
        pytest.skip(
            "no chromium binary (FTRUN_CHROMIUM, /usr/bin/chromium, /usr/bin/chromium-browser); "
            "tests/browser/install-chromium.sh installs Debian's"
        )
    return found


def http(method: str, url: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method, data=b"{}" if method != "GET" else None)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read()


def serving(url: str) -> bool:
    try:
        return http("GET", url)[0] == 200
    except OSError:
        return False


def group_ranks(job: Job) -> dict[int, str]:
    """Cycle 0's nodes by group rank."""
    return {e["group_rank"]: e["node"] for e in job.events("rendezvous_done") if e["cycle"] == 0}


def worker_pids(job: Job) -> set[int]:
    return {pid for e in job.events("workers_started") for pid in e["pids"]}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_status_page_in_a_browser_follows_a_crash_and_the_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    executable = chromium()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    port = free_port()
    base = f"http://127.0.0.1:{port}/"
    job = start_job(
        tmp_path, 2, [*LIGHT_ARGS, f"--ft-status-port={port}"], STEPS, script=FAULT, nproc=2
    )
    pids: set[int] = set()
    try:
        wait_for(lambda: serving(base + "status.json"), 30, "the status page", interval=0.1)
        with sync_api.sync_playwright() as play:
            browser = play.chromium.launch(
                executable_path=executable,
                headless=True,
                args=["--no-sandbox", "--disable-dev-shm-usage"],
            )
            try:
                shot = watch_the_page(browser, job, base, tmp_path)
            finally:
                browser.close()
        print(f"\nstatus page screenshot: {shot}")
        codes = job.wait(60)
        assert codes == [0, 0], [n.text()[-2000:] for n in job.nodes]
        assert max(e["cycle"] for e in job.events("rendezvous_done")) == 1
    finally:
        pids |= worker_pids(job)
        job.kill()  # only launchers still running after a failed assertion
    wait_for(lambda: not [p for p in pids if alive(p)], 10, "the job's workers to exit")


def watch_the_page(browser, job: Job, base: str, tmp_path: Path) -> Path:
    """Drive the page through the crash and the restart; return the screenshot's path."""
    page = browser.new_page(viewport=VIEWPORT)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on("console", lambda m: console_error(m, errors))
    deadline = time.monotonic() + 60

    def wait(script: str, arg: object, what: str) -> None:
        left_ms = max(1000.0, (deadline - time.monotonic()) * 1000)
        try:
            page.wait_for_function(script, arg=arg, timeout=left_ms, polling=100)
        except sync_api.TimeoutError:
            rows = page.locator("#nodes tbody tr").all_inner_texts()
            tails = "".join(f"\n--- launcher {n.index}:\n{n.text()[-1500:]}" for n in job.nodes)
            raise AssertionError(f"page never showed {what}; node rows: {rows}{tails}") from None

    page.goto(base, timeout=15_000)
    assert page.title() == "ftrun: job status"
    nodes = wait_for(lambda: len(g := group_ranks(job)) == 2 and g, 30, "the round's nodes")
    names = [nodes[0], nodes[1]]
    wait(ALL_IN_STATE, [names, "stepping", None], "both nodes stepping")
    assert page.locator("#nodes tbody tr").count() == 2
    assert page.locator("#cycle").text_content() == "0"
    assert page.locator("#outcome").text_content() == "RUNNING"
    assert_read_only(base, job)

    victim = next(
        e["pids"][0]
        for e in job.events("workers_started")
        if e["node"] == nodes[1] and e["cycle"] == 0
    )
    os.kill(victim, signal.SIGKILL)
    wait(VICTIM_MOVED, nodes[1], f"{nodes[1]} (group rank 1) leaving stepping")
    wait(ALL_IN_STATE, [names, "stepping", 1], "both nodes stepping again in cycle 1")
    row = page.locator(f'[id="node-{nodes[1]}"] td')
    assert row.nth(RESTARTS).text_content() == "1"
    failure = page.locator("#failures tbody tr").first.locator("td")
    assert failure.nth(0).text_content() == "0"  # the cycle
    assert failure.nth(2).text_content() == nodes[1]
    assert page.locator("#restarts").text_content() == "1"
    assert page.locator("#error").text_content() == ""
    shot = tmp_path / "status-page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert not errors, errors
    return shot


def console_error(message, errors: list[str]) -> None:
    """Errors on the console (the browser's own /favicon.ico request included: 204)."""
    if message.type == "error":
        errors.append(f"console: {message.text} ({message.location})")


def assert_read_only(base: str, job: Job) -> None:
    """Other methods than GET/HEAD are refused; the page and the job stay as they were."""
    page_before = http("GET", base)[1]
    since = time.time()
    for path in ("", "status.json"):
        for method in ("POST", "PUT", "DELETE"):
            code, _ = http(method, base + path)
            assert 400 <= code < 600, f"{method} /{path} answered {code}"
    assert http("GET", base)[1] == page_before
    status = json.loads(http("GET", base + "status.json")[1])
    assert (status["cycle"], status["restarts"]) == (0, 0)
    assert [n["state"] for n in status["nodes"]] == ["stepping", "stepping"]
    changed = [e for e in job.events() if e["ts"] >= since and e["event"] in CHANGES]
    assert not changed, changed
