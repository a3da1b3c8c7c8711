"""Names in the keeper's directory, and the bounds every name from a peer is checked against.

The layout is `DirectoryStore`'s, one store per session under the keeper's root:

    <root>/<session>/iter_0000420/rank3-of8.ftckpt

Pure: parsing and validation only. A name that does not parse is not ours (a leftover, a
temp file, something a worker left): it is skipped, never guessed at. Names that come from a
peer (a push, a fetch, a holdings message) are checked here before any path is built from
them, so no peer can name a path outside the directory.
"""

from __future__ import annotations

import re

from ftrun.checkpointing.store import SUFFIX, PartKey, iteration_dir_name, part_file_name

SESSION_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_ITERATION_DIR_RE = re.compile(r"iter_(\d{7,18})")
_PART_RE = re.compile(r"rank(\d{1,7})-of(\d{1,7})" + re.escape(SUFFIX))

MAX_ITERATION = 10**18 - 1
"""The largest iteration a name may carry (18 digits: `iter_` names stay short)."""
MAX_WORLD_SIZE = 1 << 20
MAX_SESSIONS = 64
"""Sessions (checkpoint managers) one node keeps; a peer cannot make it create more."""
MIN_PART_BYTES = 16
"""Smaller than any part's header: such a payload is rejected before anything is allocated."""


def valid_session(name: object) -> bool:
    """A session directory name: one safe path component (never `.`, `..` or empty)."""
    return (
        isinstance(name, str)
        and SESSION_RE.fullmatch(name) is not None
        and name.strip(".") != ""  # ".", "..", "...": the regex allows them, paths do not
    )


def valid_key(iteration: object, rank: object, world_size: object) -> bool:
    """Ints (never bools) in range: 0 <= iteration <= MAX_ITERATION, 0 <= rank < world_size."""
    ints = all(type(v) is int for v in (iteration, rank, world_size))
    return (
        ints
        and 0 <= iteration <= MAX_ITERATION  # type: ignore[operator]
        and 1 <= world_size <= MAX_WORLD_SIZE  # type: ignore[operator]
        and 0 <= rank < world_size  # type: ignore[operator]
    )


def parse_iteration_dir(name: str) -> int | None:
    """The iteration of a canonical `iter_<n>` name (as `DirectoryStore` writes it), else None."""
    match = _ITERATION_DIR_RE.fullmatch(name)
    if match is None:
        return None
    iteration = int(match.group(1))
    return iteration if iteration_dir_name(iteration) == name else None


def parse_part_name(name: str, iteration: int) -> PartKey | None:
    """The key of a complete part's canonical file name in `iteration`'s directory, else None
    (temp files, set-aside `.corrupt` files and anything else)."""
    match = _PART_RE.fullmatch(name)
    if match is None:
        return None
    rank, world_size = int(match.group(1)), int(match.group(2))
    if part_file_name(rank, world_size) != name or not valid_key(iteration, rank, world_size):
        return None
    return PartKey(iteration, rank, world_size)


def label(key: PartKey) -> str:
    """A part in a log line: `iteration 420 rank 3 of 8`."""
    return f"iteration {key.iteration} rank {key.rank} of {key.world_size}"
