"""`ftrun status`: the job's status as a table, from its log directory or a live status page.

From `--log-dir`, the status is built here from the events files (the same `job_status` the
page uses, without the ranks' live progress); from `--endpoint`, it is the page's own
`/status.json`. Errors are one line (`StatusInputError`).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ftrun.eventlog.job_status import job_status
from ftrun.eventlog.reader import ReportInputError, load_events

FETCH_TIMEOUT_S = 5.0


class StatusInputError(Exception):
    """The status cannot be read; the message is the one line a person sees."""


def from_log_dir(log_dir: Path) -> dict[str, Any]:
    try:
        events = load_events(log_dir)
    except ReportInputError as exc:
        raise StatusInputError(str(exc)) from None
    return job_status(log_dir.name, events.nodes, {}, time.time())


def from_endpoint(endpoint: str) -> dict[str, Any]:
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    url = url.rstrip("/") + "/status.json"
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as answer:
            data = json.loads(answer.read())
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusInputError(f"cannot read {url}: {reason}") from None
    except ValueError:
        raise StatusInputError(f"{url} did not answer with a status document") from None
    if not isinstance(data, dict) or "job" not in data:
        raise StatusInputError(f"{url} did not answer with a status document")
    return data
