"""The keeper's messages, in the store and on the peer channel: one encoder, one validating
decoder each, JSON only (never pickle).

Store values, under `ftrun/<run_id>/c<cycle>/ckpt/` (see `restore`):

    holdings  {"v": 1, "node": str, "sessions": {session: [[iteration, rank, world_size,
              nbytes], ...]}}
    decision  {"v": 1, "attempt": int, "final": bool, "sources": [int], "excluded": [int],
              "aborted": str | null, "choices": {session: [iteration, world_size, note]}}
    outcome   {"v": 1, "failed": {session: [int]}, "aborted": str | null}

Peer request fields (`ckpt-push`, `ckpt-fetch`): `session`, `iteration`, `rank`, `world_size`,
plus `cycle` for a push (the sender's round: a push from another round is refused) and `nbytes`
for a fetch (the size the fetcher allocated). Anything else in a message is an error, not
ignored: a message from another release must fail loudly.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from ftrun import untrusted_json
from ftrun.checkpointing.keeper.errors import PartRejectedError, RestoreError
from ftrun.checkpointing.keeper.holdings import Choice, Decision, Holdings, Outcome
from ftrun.checkpointing.keeper.names import MAX_ITERATION, MAX_WORLD_SIZE, valid_key, valid_session
from ftrun.checkpointing.store import PartKey

VERSION = 1
_MAX_NODES = 1 << 20
_MAX_NOTE = 500


def encode_holdings(node: str, holdings: Holdings) -> str:
    sessions = {
        session: [[k.iteration, k.rank, k.world_size, n] for k, n in sorted(parts.items())]
        for session, parts in sorted(holdings.items())
    }
    return json.dumps({"v": VERSION, "node": node, "sessions": sessions})


def decode_holdings(raw: bytes | str) -> Holdings:
    fields = _object(raw, {"v", "node", "sessions"})
    sessions = fields["sessions"]
    if not isinstance(sessions, dict):
        raise RestoreError("holdings: sessions is not an object")
    holdings: dict[str, dict[PartKey, int]] = {}
    for session, rows in sessions.items():
        if not valid_session(session) or not isinstance(rows, list):
            raise RestoreError(f"holdings: bad session {session!r:.140}")
        parts = {}
        for row in rows:
            if not (isinstance(row, list) and len(row) == 4 and valid_key(*row[:3])):
                raise RestoreError(f"holdings: bad part {row!r:.200} of session {session}")
            if type(row[3]) is not int or row[3] < 0:
                raise RestoreError(f"holdings: bad size in {row!r:.200}")
            parts[PartKey(*row[:3])] = row[3]
        holdings[session] = parts
    return holdings


def encode_decision(decision: Decision) -> str:
    choices = {s: [c.iteration, c.world_size, c.note] for s, c in sorted(decision.choices.items())}
    return json.dumps({"v": VERSION, "attempt": decision.attempt, "final": decision.final,
                       "sources": list(decision.sources), "excluded": sorted(decision.excluded),
                       "aborted": decision.aborted, "choices": choices})  # fmt: skip


def decode_decision(raw: bytes | str) -> Decision:
    keys = {"v", "attempt", "final", "sources", "excluded", "aborted", "choices"}
    fields = _object(raw, keys)
    attempt, final, aborted = fields["attempt"], fields["final"], fields["aborted"]
    if type(attempt) is not int or attempt < 0 or type(final) is not bool:
        raise RestoreError("decision: bad attempt or final flag")
    if aborted is not None and not isinstance(aborted, str):
        raise RestoreError("decision: aborted is not a string")
    choices = fields["choices"]
    if not isinstance(choices, dict):
        raise RestoreError("decision: choices is not an object")
    return Decision(attempt, final, {s: _choice(s, c) for s, c in choices.items()},
                    tuple(_nodes(fields["sources"])), frozenset(_nodes(fields["excluded"])),
                    aborted)  # fmt: skip


def encode_outcome(outcome: Outcome) -> str:
    failed = {s: sorted(holders) for s, holders in sorted(outcome.failed.items())}
    return json.dumps({"v": VERSION, "failed": failed, "aborted": outcome.aborted})


def decode_outcome(raw: bytes | str) -> Outcome:
    fields = _object(raw, {"v", "failed", "aborted"})
    failed, aborted = fields["failed"], fields["aborted"]
    if not isinstance(failed, dict) or not all(valid_session(s) for s in failed):
        raise RestoreError("outcome: failed is not an object of sessions")
    if aborted is not None and not isinstance(aborted, str):
        raise RestoreError("outcome: aborted is not a string")
    return Outcome({s: frozenset(_nodes(h)) for s, h in failed.items()}, aborted)


def part_request(
    session: str, key: PartKey, *, cycle: int | None = None, nbytes: int | None = None
) -> dict[str, Any]:
    """The fields of a push (with `cycle`) or a fetch (with `nbytes`) of one part."""
    extra = {name: n for name, n in (("cycle", cycle), ("nbytes", nbytes)) if n is not None}
    return {"session": session, **dataclasses.asdict(key), **extra}


def parse_part_request(header: Mapping[str, Any], extra: str) -> tuple[str, PartKey, int]:
    """(session, part, the `extra` field: "cycle" or "nbytes") of a peer's request; raises
    `PartRejectedError` naming the first thing wrong."""
    expected = {"session", "iteration", "rank", "world_size", extra}
    if set(header) != expected:
        raise PartRejectedError(f"fields {sorted(header)!r:.300}, expected {sorted(expected)}")
    session = header["session"]
    if not valid_session(session):
        raise PartRejectedError(f"bad session name {session!r:.140}")
    iteration, rank, world_size = header["iteration"], header["rank"], header["world_size"]
    if not valid_key(iteration, rank, world_size):
        raise PartRejectedError(
            f"bad part: iteration {iteration!r:.30}, rank {rank!r:.30} of {world_size!r:.30} "
            f"(iteration <= {MAX_ITERATION}, world size <= {MAX_WORLD_SIZE})"
        )
    value = header[extra]
    if type(value) is not int or value < 0:
        raise PartRejectedError(f"bad {extra}: {value!r:.30}")
    return session, PartKey(iteration, rank, world_size), value


def _object(raw: bytes | str, keys: set[str]) -> dict[str, Any]:
    try:
        fields = untrusted_json.loads(raw)
    except ValueError:
        raise RestoreError("not a JSON message") from None
    if not isinstance(fields, dict) or set(fields) != keys:
        raise RestoreError(f"not a keeper message with fields {sorted(keys)}")
    if fields["v"] != VERSION:
        raise RestoreError(
            f"keeper message version {fields['v']!r:.20}, this ftrun speaks {VERSION}"
        )
    return fields


def _choice(session: str, raw: Any) -> Choice:
    if not valid_session(session) or not (isinstance(raw, list) and len(raw) == 3):
        raise RestoreError(f"decision: bad choice for session {session!r:.140}")
    iteration, world_size, note = raw
    if type(iteration) is not int or not -1 <= iteration <= MAX_ITERATION:
        raise RestoreError(f"decision: bad iteration {iteration!r:.30}")
    if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise RestoreError(f"decision: bad world size {world_size!r:.30}")
    if not isinstance(note, str):
        raise RestoreError("decision: note is not a string")
    return Choice(iteration, world_size, note[:_MAX_NOTE])


def _nodes(raw: Any) -> list[int]:
    if not isinstance(raw, list) or not all(type(n) is int and 0 <= n < _MAX_NODES for n in raw):
        raise RestoreError(f"not a list of group ranks: {raw!r:.100}")
    return raw
