"""The global tier's directory layout and manifest: names, integrity data, retention. Pure
except for the few small I/O helpers at the end (listing, checksumming, fsync).

    <root>/iter_0000123/            a complete checkpoint: DCP's files + MANIFEST
    <root>/.iter_0000123.<token>.tmp/   a save in progress (or abandoned by a crash)
    <root>/iter_0000123.corrupt/    set aside by a load that failed; never read again
    <root>/.trash.<name>.<token>/   being removed (renamed first, so no half-removed
                                    directory is ever visible under a valid name)

Only `iter_<digits>` directories holding a MANIFEST count. The manifest is JSON: the format,
the iteration, the world size of the save, and for every file DCP wrote (`.metadata` and the
`.distcp` data files) its size and CRC-32C, plus a CRC-32C of the manifest itself. Each rank
checksums the files it wrote (`files_of_rank`), off the training path, and leaves the result in
a small sidecar (`sidecar_name`) that rank 0 folds into the manifest at the finalize.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import crc32c

from ftrun import untrusted_json
from ftrun.checkpointing.layout import canonical, checksum

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "ftrun-global-1"
DCP_METADATA = ".metadata"
SIDECAR_PREFIX = ".crc-rank"
_ITER_RE = re.compile(r"^iter_(\d{7,19})$")
_TMP_RE = re.compile(r"^\.iter_(\d{7,19})\.([0-9a-f]{16})\.tmp$")
_DCP_RANK_RE = re.compile(r"^__(\d+)_\d+\.distcp$")
_CHUNK = 64 * 1024 * 1024


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as the manifest records it."""

    size: int
    crc32c: int


@dataclass(frozen=True)
class Manifest:
    """What a complete global checkpoint holds."""

    iteration: int
    world_size: int
    files: Mapping[str, FileEntry]


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def parse_iter_dir_name(name: str) -> int | None:
    """The iteration of a visible checkpoint directory's name, or None for any other name."""
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


def tmp_dir_name(iteration: int, token: int) -> str:
    return f".iter_{iteration:07d}.{token:016x}.tmp"


def is_tmp_dir_name(name: str) -> bool:
    return _TMP_RE.match(name) is not None


def sidecar_name(rank: int) -> str:
    return f"{SIDECAR_PREFIX}{rank}.json"


def files_of_rank(names: Iterable[str], rank: int, world_size: int) -> list[str]:
    """The files `rank` checksums: the data files DCP's FileSystemWriter named after it
    (`__<rank>_<k>.distcp`); rank 0 also takes `.metadata` and anything not so named."""
    mine = []
    for name in sorted(names):
        if name == MANIFEST or name.startswith(SIDECAR_PREFIX):
            continue
        match = _DCP_RANK_RE.match(name)
        owner = int(match.group(1)) if match else 0
        if owner == rank or (rank == 0 and owner >= world_size):
            mine.append(name)
    return mine


def encode_entries(entries: Mapping[str, FileEntry]) -> bytes:
    return json.dumps(_as_json(entries), separators=(",", ":")).encode()


def decode_entries(raw: bytes) -> dict[str, FileEntry]:
    """A sidecar's entries; `ValueError` if it is not what `encode_entries` writes."""
    try:
        data = untrusted_json.loads(raw)
    except ValueError:  # UnicodeDecodeError is one
        raise ValueError("not JSON") from None
    if type(data) is not dict:
        raise ValueError("not a JSON object")
    return {name: _entry(name, value) for name, value in data.items()}


def encode_manifest(manifest: Manifest) -> bytes:
    body: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "iteration": manifest.iteration,
        "world_size": manifest.world_size,
        "files": _as_json(manifest.files),
    }
    body["manifest_crc32c"] = f"{checksum(canonical(body)):08x}"
    return canonical(body) + b"\n"


def decode_manifest(raw: bytes) -> Manifest:
    """Parse and validate a manifest; `ValueError` naming what is wrong."""
    try:
        body = untrusted_json.loads(raw)
    except ValueError:
        raise ValueError("the manifest is not JSON") from None
    if type(body) is not dict or body.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"the manifest is not {MANIFEST_FORMAT!r}")
    stored = body.pop("manifest_crc32c", None)
    if stored != f"{checksum(canonical(body)):08x}":
        raise ValueError("manifest checksum mismatch")
    iteration, world_size, files = body.get("iteration"), body.get("world_size"), body.get("files")
    if type(iteration) is not int or iteration < 0 or type(world_size) is not int:
        raise ValueError("the manifest's iteration or world_size is not an integer")
    if type(files) is not dict or DCP_METADATA not in files:
        raise ValueError(f"the manifest lists no {DCP_METADATA}")
    entries = {name: _entry(name, value) for name, value in files.items()}
    return Manifest(iteration, world_size, MappingProxyType(entries))


def retention(visible: Iterable[int], saved: int, keep_last: int) -> list[int]:
    """The visible iterations to remove once `saved` is visible: all but the `keep_last`
    newest at or below it, and every one above it (left by a run that was rolled back)."""
    at_or_below = sorted(i for i in visible if i <= saved)
    newer = sorted(i for i in visible if i > saved)
    return at_or_below[: max(0, len(at_or_below) - keep_last)] + newer


def _as_json(entries: Mapping[str, FileEntry]) -> dict[str, list[Any]]:
    return {name: [e.size, f"{e.crc32c:08x}"] for name, e in sorted(entries.items())}


def _entry(name: Any, value: Any) -> FileEntry:
    if type(name) is not str or "/" in name or name in ("", ".", ".."):
        raise ValueError(f"bad file name {str(name)[:40]!r}")
    if type(value) is not list or len(value) != 2 or type(value[0]) is not int:
        raise ValueError(f"{name}: not a [size, crc32c] entry")
    size, crc = value
    if size < 0 or type(crc) is not str or len(crc) != 8:
        raise ValueError(f"{name}: bad size or checksum")
    try:
        return FileEntry(size, int(crc, 16))
    except ValueError:
        raise ValueError(f"{name}: checksum is not hexadecimal") from None


# I/O helpers -----------------------------------------------------------------------------------


def file_entry(path: Path) -> FileEntry:
    """Size and CRC-32C of a file, read in chunks (crc32c releases the GIL on large buffers)."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = crc32c.crc32c(view[:n], crc)  # layout.checksum, continued across chunks
            size += n
    return FileEntry(size, crc)


def verify_files(directory: Path, names: Sequence[str], manifest: Manifest) -> None:
    """Raise `ValueError` for the first of `names` that is missing or differs from `manifest`."""
    for name in names:
        expected = manifest.files[name]
        try:
            actual = file_entry(directory / name)
        except FileNotFoundError:
            raise ValueError(f"{name} is missing") from None
        if actual.size != expected.size:
            raise ValueError(f"{name}: {actual.size} bytes, the manifest says {expected.size}")
        if actual.crc32c != expected.crc32c:
            raise ValueError(f"{name}: checksum mismatch")


def write_durably(path: Path, data: bytes) -> None:
    """Write `data` to a new file and fsync it (the caller renames or fsyncs the directory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def list_visible(root: Path) -> list[int]:
    """The iterations with a visible directory (complete or not yet checked), ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(i for name in names if (i := parse_iter_dir_name(name)) is not None)
