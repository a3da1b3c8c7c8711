"""The byte layout of one checkpoint part: safetensors', so standard tools can read the tensors.

    [N: 8 bytes, little-endian u64][header: N bytes of JSON, space-padded][tensor bytes]

The header maps tensor names to `{"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]}`,
offsets counted from the first byte after the header, plus `"__metadata__"`, a str -> str map
(safetensors allows only strings there). Ours holds, under the reserved `ftckpt.` prefix:

* `ftckpt.version`   - the format version (`FORMAT_VERSION`);
* `ftckpt.iteration` - the training iteration the part belongs to;
* `ftckpt.skeleton`  - the JSON skeleton of the state (see `flatten`);
* `ftckpt.crc32c`    - one CRC-32C per tensor, in name order, 8 hex digits each, comma-joined;
* `ftckpt.header_crc32c` - the CRC-32C of the canonical header JSON without this key.

Tensors are named `t0`, `t1`, ... in flatten order. Their bytes are laid out by element size,
largest first, and N is padded so the data starts 8-byte aligned: every tensor then starts at a
multiple of its element size, which safetensors' own writer also arranges and which lets the
writer copy into typed views of the file mapping. The data is packed with no gaps (standard
readers reject gaps).

CRC-32C (the `crc32c` package: the CPU's crc32 instruction, about one memcpy per byte on one
core, releasing the GIL on large buffers; zlib's CRC-32 was 4x slower and dominated a restore)
catches flipped bytes and truncation. It is not a defence against someone who edits the file on
purpose: they can recompute it. The header checksum covers the checksums and the skeleton.

Everything here is pure (no I/O): `plan` before writing, `encode_header` once the tensor bytes
are in place, `decode_header` on read. Decoding raises `ValueError`; the reader adds the file name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import crc32c
import torch

from ftrun import untrusted_json
from ftrun.checkpointing.errors import CheckpointFormatError

FORMAT_VERSION = "2"  # 2: CRC-32C instead of zlib's CRC-32
PREFIX_BYTES = 8
ALIGN = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own bound; refuse before reading more
METADATA = "__metadata__"
RESERVED = "ftckpt."
KEY_VERSION = "ftckpt.version"
KEY_ITERATION = "ftckpt.iteration"
KEY_SKELETON = "ftckpt.skeleton"
KEY_CRC = "ftckpt.crc32c"
KEY_HEADER_CRC = "ftckpt.header_crc32c"
_CRC_PLACEHOLDER = "0" * 8


def checksum(data: Any) -> int:
    """The CRC-32C of a bytes-like object (a memoryview of a mapping hashes without a copy)."""
    return crc32c.crc32c(data)


def _dtype_names() -> dict[torch.dtype, str]:
    names = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
        torch.complex64: "C64",
    }
    optional = {  # newer dtypes: present in the torch builds that have them
        "uint16": "U16",
        "uint32": "U32",
        "uint64": "U64",
        "float8_e4m3fn": "F8_E4M3",
        "float8_e5m2": "F8_E5M2",
        "float8_e8m0fnu": "F8_E8M0",
    }
    for attr, name in optional.items():
        if isinstance(getattr(torch, attr, None), torch.dtype):
            names[getattr(torch, attr)] = name
    return names


DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType(_dtype_names())
DTYPES: Mapping[str, torch.dtype] = MappingProxyType({v: k for k, v in DTYPE_NAMES.items()})


@dataclass(frozen=True)
class Entry:
    """One tensor's place in the part: `begin`/`end` count from the start of the data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Layout:
    """Where everything goes, fixed before a byte is written (checksums come later, in
    fixed-width fields, so the header length does not change)."""

    entries: tuple[Entry, ...]
    metadata: Mapping[str, str]
    header_len: int
    data_size: int

    @property
    def data_start(self) -> int:
        return PREFIX_BYTES + self.header_len

    @property
    def total(self) -> int:
        return self.data_start + self.data_size


@dataclass(frozen=True)
class Header:
    """A decoded, validated header."""

    entries: tuple[Entry, ...]
    iteration: int
    skeleton_json: str
    crcs: tuple[int, ...]
    user_metadata: Mapping[str, str]
    header_len: int


def plan(
    tensors: Sequence[torch.Tensor],
    skeleton_json: str,
    iteration: int,
    user_metadata: Mapping[str, str] | None,
) -> Layout:
    """Place every tensor and size the header."""
    metadata = _check_user_metadata(user_metadata or {})
    metadata.update(
        {KEY_VERSION: FORMAT_VERSION, KEY_ITERATION: str(iteration), KEY_SKELETON: skeleton_json}
    )
    spans: dict[int, tuple[int, int]] = {}
    offset = 0
    for i in sorted(range(len(tensors)), key=lambda i: (-tensors[i].element_size(), i)):
        nbytes = tensors[i].numel() * tensors[i].element_size()
        spans[i] = (offset, offset + nbytes)
        offset += nbytes
    entries = tuple(
        Entry(f"t{i}", t.dtype, tuple(t.shape), *spans[i]) for i, t in enumerate(tensors)
    )
    draft = _header(entries, metadata, [0] * len(entries))
    draft[METADATA][KEY_HEADER_CRC] = _CRC_PLACEHOLDER
    header_len = -(-len(canonical(draft)) // ALIGN) * ALIGN
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointFormatError(
            f"the part's header would be {header_len} bytes (limit {MAX_HEADER_BYTES}): "
            "the state has too many non-tensor values"
        )
    return Layout(entries, MappingProxyType(metadata), header_len, offset)


def encode_header(layout: Layout, crcs: Sequence[int]) -> bytes:
    """The header bytes, exactly `layout.header_len` long, with the checksums filled in."""
    header = _header(layout.entries, layout.metadata, crcs)
    header[METADATA][KEY_HEADER_CRC] = f"{checksum(canonical(header)):08x}"
    raw = canonical(header)
    if len(raw) > layout.header_len:  # cannot happen: every checksum field is fixed-width
        raise AssertionError(f"header grew from {layout.header_len} to {len(raw)} bytes")
    return raw.ljust(layout.header_len, b" ")


def decode_header(raw: bytes, data_size: int) -> Header:
    """Parse and validate a header; `data_size` is how many bytes follow it in the file."""
    try:
        header = untrusted_json.loads(raw.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError is one
        raise ValueError(f"the header is not JSON ({type(e).__name__})") from None
    if type(header) is not dict or type(header.get(METADATA)) is not dict:
        raise ValueError("the header is not a safetensors header with __metadata__")
    metadata: dict[str, Any] = header[METADATA]
    if not all(type(v) is str for v in metadata.values()):
        raise ValueError("__metadata__ holds a value that is not a string")
    version = metadata.get(KEY_VERSION)
    if version is None:
        raise ValueError("not an ftrun checkpoint part (no ftckpt.version in __metadata__)")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"format version {version[:20]!r} is not supported (reads {FORMAT_VERSION})"
        )
    stored_crc = metadata.pop(KEY_HEADER_CRC, None)
    if stored_crc != f"{checksum(canonical(header)):08x}":
        raise ValueError("header checksum mismatch (the header was altered or damaged)")
    del header[METADATA]
    entries = _entries(header)
    _check_packed(entries, data_size)
    user = {k: v for k, v in metadata.items() if not k.startswith(RESERVED)}
    return Header(entries=entries,
                  iteration=_parse_int(metadata.get(KEY_ITERATION), KEY_ITERATION),
                  skeleton_json=_required(metadata, KEY_SKELETON),
                  crcs=_parse_crcs(_required(metadata, KEY_CRC), len(entries)),
                  user_metadata=MappingProxyType(user), header_len=len(raw))  # fmt: skip


def _header(
    entries: Sequence[Entry], metadata: Mapping[str, str], crcs: Sequence[int]
) -> dict[str, Any]:
    header: dict[str, Any] = {
        e.name: {
            "dtype": DTYPE_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [e.begin, e.end],
        }
        for e in entries
    }
    header[METADATA] = {**metadata, KEY_CRC: ",".join(f"{crc:08x}" for crc in crcs)}
    return header


def canonical(header: Mapping[str, Any]) -> bytes:
    """One byte string per header (or global manifest), so a reader can recompute its checksum."""
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _check_user_metadata(user: Mapping[str, str]) -> dict[str, str]:
    for key, value in user.items():
        if type(key) is not str or type(value) is not str:
            raise CheckpointFormatError(f"metadata {key!r}: keys and values must be str")
        if key.startswith(RESERVED) or key == METADATA:
            raise CheckpointFormatError(f"metadata {key!r}: the prefix {RESERVED!r} is reserved")
    return dict(user)


def _entries(tensors: dict[str, Any]) -> tuple[Entry, ...]:
    names = [f"t{i}" for i in range(len(tensors))]
    if set(tensors) != set(names):
        raise ValueError(f"tensor names are not t0..t{len(names) - 1}")
    return tuple(_entry(name, tensors[name]) for name in names)


def _entry(name: str, spec: Any) -> Entry:
    if type(spec) is not dict or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {name}: not a dtype/shape/data_offsets entry")
    dtype = DTYPES.get(spec["dtype"]) if type(spec["dtype"]) is str else None
    if dtype is None:
        raise ValueError(f"tensor {name}: unknown dtype {str(spec['dtype'])[:20]!r}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor {name}: bad shape")
    if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise ValueError(f"tensor {name}: bad data_offsets")
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if begin < 0 or end - begin != expected:
        raise ValueError(f"tensor {name}: data_offsets {offsets} do not hold {expected} bytes")
    return Entry(name, dtype, tuple(shape), begin, end)


def _check_packed(entries: Sequence[Entry], data_size: int) -> None:
    """The tensors tile the data exactly: no gap, no overlap, nothing missing or after them."""
    position = 0
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin != position:
            raise ValueError(f"tensor {entry.name} starts at {entry.begin}, expected {position}")
        position = entry.end
    if position > data_size:
        raise ValueError(
            f"truncated: the header describes {position} data bytes, found {data_size}"
        )
    if position < data_size:
        raise ValueError(f"{data_size - position} unexpected bytes after the last tensor")


def _required(metadata: Mapping[str, str], key: str) -> str:
    if key not in metadata:
        raise ValueError(f"{key} is missing from __metadata__")
    return metadata[key]


def _parse_int(text: str | None, key: str) -> int:
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 20:
        raise ValueError(f"{key} is not a non-negative integer")
    return int(text)


def _parse_crcs(text: str, count: int) -> tuple[int, ...]:
    fields = text.split(",") if text else []
    if len(fields) != count or not all(len(f) == 8 for f in fields):
        raise ValueError(f"{KEY_CRC} does not hold {count} checksums")
    try:
        return tuple(int(f, 16) for f in fields)
    except ValueError:
        raise ValueError(f"{KEY_CRC} is not hexadecimal") from None
