"""The checkpoint part format: round trips, a safetensors-layout reader of our own, refusals
that name the path, damage found on read, no pickle on the load path, failed writes clean up.

Real files in tmp_path; nothing in the format is mocked (one seam, `part_write._copy_into`, is made
to fail with ENOSPC half-way through a write).
"""

from __future__ import annotations

import collections
import enum
import errno
import itertools
import json
import logging
import math
import pickle
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

from ftrun.checkpointing import part_write, pinning
from ftrun.checkpointing.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from ftrun.checkpointing.format import read_info, read_part
from ftrun.checkpointing.layout import DTYPE_NAMES
from ftrun.checkpointing.part_write import write_part
from ftrun.checkpointing.recycled import Recycled

SAFETENSORS_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "C64": 8, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes in C order, without numpy (bf16 and float8 have no numpy dtype)."""
    flat = tensor.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8)
    return bytes(flat.tolist())


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs included), so the comparison is of bytes, not values."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = math.prod(shape) * dtype.itemsize
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (data % 2).view(torch.bool).view(shape)
    return data.view(dtype).view(shape)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and raw_bytes(a) == raw_bytes(b)


def sample_state() -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    return {
        "dtypes": {
            str(dtype): random_tensor(dtype, (3, 5), i) for i, dtype in enumerate(DTYPE_NAMES)
        },
        "scalar": torch.tensor(7.5, dtype=torch.float64),
        "empty": torch.empty(0, 3, dtype=torch.bfloat16),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "conj": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),
        "optimizer": {
            "param_groups": [
                {"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None, "params": [0, 1]}
            ],
            "state": {"0": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4)}},
        },
        "plain": [True, False, None, 0, -1, 2**100, -(2**80), 1.5, -0.0, "żółw", "", [], {}, ()],
        "nonfinite": (math.nan, math.inf, -math.inf),
        "blob": b"\x00\xffbytes",
        "no_blob": b"",
        "$tensor": {"$dict": 1},  # user keys that look like skeleton tags
        "nested": ((1, (2, [3, (4,)])),),
    }


def assert_same(saved: Any, loaded: Any, where: str = "state") -> None:
    assert type(loaded) is (dict if isinstance(saved, dict) else type(saved)), where
    if isinstance(saved, torch.Tensor):
        assert same_tensor(saved, loaded), where
    elif isinstance(saved, dict):
        assert list(saved) == list(loaded), where
        for key in saved:
            assert_same(saved[key], loaded[key], f"{where}[{key!r}]")
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(loaded), where
        for i, (a, b) in enumerate(zip(saved, loaded, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(saved, float) and math.isnan(saved):
        assert math.isnan(loaded), where
    elif isinstance(saved, float):
        assert saved == loaded and math.copysign(1, saved) == math.copysign(1, loaded), where
    else:
        assert saved == loaded, where


def test_round_trip_of_every_kind_of_value(tmp_path: Path) -> None:
    state = sample_state()
    path = tmp_path / "part.ftckpt"
    written = write_part(path, state, iteration=42, metadata={"note": "hi"})
    loaded, info = read_part(path)
    assert_same(state, loaded)
    assert info.iteration == written.iteration == 42
    assert info.checksums_verified and info.metadata == {"note": "hi"}
    assert info.nbytes == written.nbytes == path.stat().st_size
    assert info.tensor_count == written.tensor_count
    assert read_info(path).iteration == 42
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.ftckpt"]


def test_tied_tensors_are_stored_once_and_stay_tied(tmp_path: Path) -> None:
    weight = torch.randn(8, 4)
    state = {"embed": weight, "head": weight.detach(), "other": weight[1:]}
    info = write_part(tmp_path / "p", state, 1)
    assert info.tensor_count == 2
    loaded, _ = read_part(tmp_path / "p")
    assert loaded["embed"] is loaded["head"]
    assert torch.equal(loaded["other"], weight[1:])


def test_loaded_tensors_are_zero_copy_and_copy_on_write(tmp_path: Path) -> None:
    a, b = torch.arange(1024, dtype=torch.int64), torch.ones(256, dtype=torch.int64)
    path = tmp_path / "p"
    write_part(path, {"a": a, "b": b}, 1)
    header = parse_safetensors(path.read_bytes())[0]
    loaded, _ = read_part(path)
    # Both tensors sit in one mapping of the file, as far apart as their bytes in it.
    gap = header["t1"]["data_offsets"][0] - header["t0"]["data_offsets"][0]
    assert loaded["b"].data_ptr() - loaded["a"].data_ptr() == gap
    loaded["a"][0] = -5  # private page: no warning, and the file keeps its bytes
    again, _ = read_part(path)
    assert again["a"][0] == 0 and loaded["a"][0] == -5


def parse_safetensors(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """An independent reader of the safetensors layout: (header, data)."""
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    return header, blob[8 + length :]


def test_file_follows_the_safetensors_layout(tmp_path: Path) -> None:
    state = sample_state()
    path = tmp_path / "p"
    write_part(path, state, 7)
    blob = path.read_bytes()
    header, data = parse_safetensors(blob)
    assert (len(blob) - len(data)) % 8 == 0, "tensor data must start 8-byte aligned"
    metadata = header.pop("__metadata__")
    assert all(isinstance(v, str) for v in metadata.values())
    assert metadata["ftckpt.iteration"] == "7" and metadata["ftckpt.version"] == "2"
    names = [f"t{i}" for i in range(len(header))]
    assert sorted(header) == sorted(names)
    spans = sorted(tuple(header[n]["data_offsets"]) for n in names)
    assert spans[0][0] == 0 and spans[-1][1] == len(data)
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(spans))
    crcs = metadata["ftckpt.crc32c"].split(",")
    by_dtype = {}
    for name in names:
        entry = header[name]
        begin, end = entry["data_offsets"]
        itemsize = SAFETENSORS_ITEMSIZE[entry["dtype"]]
        assert end - begin == math.prod(entry["shape"]) * itemsize
        assert begin % itemsize == 0
        assert f"{crc32c.crc32c(data[begin:end]):08x}" == crcs[int(name[1:])]
        by_dtype[entry["dtype"], tuple(entry["shape"])] = data[begin:end]
    for dtype, tensor in state["dtypes"].items():
        assert by_dtype[DTYPE_NAMES[getattr(torch, dtype[len("torch.") :])], (3, 5)] == raw_bytes(
            tensor
        )
    skeleton = json.loads(metadata["ftckpt.skeleton"])
    assert skeleton["$dict"]["blob"] == {"$bytes": skeleton["$dict"]["blob"]["$bytes"]}
    floats = [{"$float": "nan"}, {"$float": "inf"}, {"$float": "-inf"}]
    assert skeleton["$dict"]["nonfinite"] == {"$tuple": floats}


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            {"optimizer": {"param_groups": [{"fn": lambda x: x}]}},
            "state['optimizer']['param_groups'][0]['fn']: "
            "a function cannot be stored without pickle",
        ),
        ({"s": {1, 2}}, "state['s']: a set (store a sorted list instead) cannot be stored"),
        ({"d": {1.5: "x"}}, "state['d']: dict key '1.5' is a float; only str and int keys"),
        ({"o": [object()]}, "state['o'][0]: a builtins.object cannot be stored without pickle"),
        ({"e": Color.RED}, "state['e']: a Color (a subclass of int"),
        ({"p": collections.namedtuple("P", "x")(1)}, "state['p']: a P (a subclass of tuple"),
        ({"b": bytearray(b"x")}, "state['b']: a bytearray (convert it to bytes)"),
        ({"t": torch.zeros(2, dtype=torch.complex128)}, "state['t']: a torch.complex128 tensor"),
        ({"t": torch.zeros(2).to_sparse()}, "state['t']: a torch.sparse_coo tensor"),
        ({"t": torch.zeros(2, device="meta")}, "state['t']: a meta tensor (it has no data)"),
        ({"i": 1 << 20_000}, "state['i']: an int of 20001 bits is too big"),
    ],
)
def test_unstorable_values_are_refused_by_path(tmp_path: Path, state: Any, message: str) -> None:
    with pytest.raises(CheckpointFormatError) as info:
        write_part(tmp_path / "p", state, 1)
    assert str(info.value).startswith(message), str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_a_state_containing_itself_is_refused(tmp_path: Path) -> None:
    state: dict[str, Any] = {"a": []}
    state["a"].append(state)
    with pytest.raises(
        CheckpointFormatError, match=r"state\['a'\]\[0\]: the state contains itself"
    ):
        write_part(tmp_path / "p", state, 1)


def flip_byte(path: Path, offset: int) -> None:
    blob = bytearray(path.read_bytes())
    blob[offset] ^= 0x01
    path.write_bytes(bytes(blob))


def test_a_flipped_data_byte_is_found(tmp_path: Path) -> None:
    path = tmp_path / "p"
    write_part(path, {"w": torch.zeros(100)}, 1)
    flip_byte(path, path.stat().st_size - 3)
    with pytest.raises(CheckpointCorruptError, match=r"/p: checksum mismatch in tensor t0"):
        read_part(path)
    read_info(path)  # the header alone is fine
    loaded, info = read_part(path, verify=False)  # unverified: loads, and says so
    assert not info.checksums_verified and loaded["w"].count_nonzero() == 1


def resign(path: Path, change: Any) -> None:
    """Rewrite the header through `change(header)`, re-signing it as the spec says (CRC-32C of
    the canonical JSON without the header checksum) and keeping its length."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    header["__metadata__"].pop("ftckpt.header_crc32c")
    change(header)
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    header["__metadata__"]["ftckpt.header_crc32c"] = f"{crc32c.crc32c(canonical):08x}"
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode().ljust(length)
    assert len(raw) == length
    path.write_bytes(blob[:8] + raw + blob[8 + length :])


def set_meta(key: str, value: str) -> Any:
    return lambda header: header["__metadata__"].__setitem__(key, value)


def set_dtype(name: str) -> Any:
    return lambda header: header["t0"].__setitem__("dtype", name)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[:-1], "truncated: the header describes"),
        (lambda b: b[:5], "truncated (5 bytes, no header length)"),
        (lambda b: b"", "truncated (0 bytes"),
        (lambda b: b[:20], "truncated (20 bytes, the header alone is"),
        (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "exceeds the 104857600-byte limit"),
        (lambda b: b + b"\0", "1 unexpected bytes after the last tensor"),
        (lambda b: bytes(range(256)) * 4, "header length"),
        (lambda b: struct.pack("<Q", 8) + b"garbage!" + b[16:], "the header is not JSON"),
        (lambda b: b.replace(b'version":"2"', b'version":"9"'), "format version '9' is not"),
        (lambda b: b.replace(b'iteration":"3"', b'iteration":"4"'), "header checksum mismatch"),
        (lambda b: b.replace(b"ftckpt.", b"xtckpt."), "not an ftrun checkpoint part"),
    ],
)  # fmt: skip
def test_damaged_files_are_refused(tmp_path: Path, damage: Any, message: str) -> None:
    path = tmp_path / "p"
    write_part(path, {"w": torch.arange(10), "x": [1.0]}, 3)
    path.write_bytes(damage(path.read_bytes()))
    for read in (read_part, read_info):
        with pytest.raises(CheckpointCorruptError) as info:
            read(path)
        assert str(info.value).startswith(f"{path}: "), str(info.value)
        assert message in str(info.value), str(info.value)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (set_dtype("F128"), "tensor t0: unknown dtype 'F128'"),
        (set_dtype("I32"), "tensor t0: data_offsets [0, 80] do not hold 40 bytes"),
        (set_meta("ftckpt.crc32c", "zz"), "does not hold 1 checksums"),
        (
            set_meta("ftckpt.skeleton", '{"$tensor": 5}'),
            "bad skeleton: tensor index 5 out of range",
        ),
        (set_meta("ftckpt.skeleton", '{"$nope": 1}'), "bad skeleton: unexpected skeleton node"),
        (set_meta("ftckpt.iteration", "-1"), "ftckpt.iteration is not a non-negative integer"),
        (lambda h: h.update(t5=h.pop("t0")), "tensor names are not t0..t0"),
    ],
)
def test_well_signed_but_invalid_headers_are_refused(
    tmp_path: Path, change: Any, message: str
) -> None:
    path = tmp_path / "p"
    write_part(path, {"w": torch.arange(10)}, 3)
    resign(path, change)
    with pytest.raises(CheckpointCorruptError, match=r"^" + str(path)) as info:
        read_part(path)
    assert message in str(info.value), str(info.value)


def test_a_missing_part_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint part"):
        read_part(tmp_path / "absent")


def test_loading_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p"
    state = sample_state()
    write_part(path, state, 1)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle/torch.load/eval used on the load path")

    for target, name in [
        (pickle, "loads"),
        (pickle, "load"),
        (pickle, "Unpickler"),
        (torch, "load"),
        (__import__("builtins"), "eval"),
    ]:
        monkeypatch.setattr(target, name, forbidden)
    loaded, _ = read_part(path)
    read_info(path)
    assert_same(state, loaded)


def test_a_write_failing_half_way_leaves_the_old_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = {"w": torch.arange(4)}
    write_part(tmp_path / "a", old, 1)
    write_part(tmp_path / "b", old, 1)
    copies = []
    real_copy = part_write._copy_into

    def copy_then_fill_the_disk(
        dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
    ) -> None:
        copies.append(1)
        if len(copies) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_copy(dst, src, non_blocking)

    monkeypatch.setattr(part_write, "_copy_into", copy_then_fill_the_disk)
    with pytest.raises(CheckpointWriteError) as info:
        write_part(tmp_path / "b", {"x": torch.ones(100), "y": torch.ones(100)}, 2)
    assert (
        str(info.value) == f"cannot write checkpoint part {tmp_path / 'b'}: No space left on device"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    for name in ("a", "b"):
        loaded, part = read_part(tmp_path / name)
        assert part.iteration == 1 and torch.equal(loaded["w"], old["w"])


def test_reserved_metadata_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match=r"prefix 'ftckpt\.' is reserved"):
        write_part(tmp_path / "p", {}, 1, metadata={"ftckpt.iteration": "5"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_are_copied_to_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {
        "w": torch.randn(64, 32, device="cuda").t(),
        "b": torch.ones(3, device="cuda", dtype=torch.bfloat16),
        "big": torch.randn(2**24, device="cuda"),  # 64 MiB: a DMA still running would show
        "step": torch.tensor(7.0),
    }
    write_part(tmp_path / "p", state, 1)  # a one-shot mapping: not page-locked
    loaded, _ = read_part(tmp_path / "p")
    assert loaded["w"].device.type == "cpu"
    assert all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())
    # A kept mapping in node memory (the store's recycling) is page-locked once and written by
    # async copies, complete when prepare_part returns: commit checksums the mapping at once.
    registered = []
    real = pinning._register
    monkeypatch.setattr(pinning, "_register", lambda *a: registered.append(a) or real(*a))
    on_disk = part_write.prepare_part(tmp_path / "d", state, 2, keep_mapping=True)
    on_disk.commit()
    assert not registered and on_disk.kept_mapping is not None  # a disk file's: never pinned
    on_disk.kept_mapping.close()
    shm = Path(tempfile.mkdtemp(prefix="ftrun-test-pin-", dir="/dev/shm"))
    try:
        pending = part_write.prepare_part(shm / "k", state, 2, keep_mapping=True)
        info = pending.commit()
        mapping = pending.kept_mapping
        assert isinstance(mapping, pinning.Mapping) and mapping._pinned is not None
        loaded, _ = read_part(shm / "k")  # its checksums were taken as commit began
        assert all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())
        del loaded
        state2 = {k: v * 2 for k, v in state.items()}
        recycled = Recycled(shm / "k", info.nbytes, mapping)
        part_write.prepare_part(shm / "k", state2, 3, recycled=recycled, keep_mapping=True).commit()
        assert len(registered) == 1 and mapping._pinned is not None  # the recycled: still pinned
        loaded, _ = read_part(shm / "k")
        assert all(torch.equal(loaded[k], v.cpu()) for k, v in state2.items())
        del loaded
        mapping.close()  # unregisters first
        assert mapping._pinned is None and torch.ones(2, device="cuda").sum().item() == 2.0
    finally:
        shutil.rmtree(shm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copies_fall_back_when_memory_cannot_be_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cudart = torch.cuda.cudart()
    monkeypatch.setattr(pinning, "_disabled", False)
    # A real failure (NULL address): CUDA keeps it as its last error, which must not surface in
    # torch's next kernel launch.
    null_register = lambda _, size: int(cudart.cudaHostRegister(0, size, 1))  # noqa: E731
    monkeypatch.setattr(pinning, "_register", null_register)
    state = {"w": torch.randn(1000, device="cuda"), "b": torch.ones(3, device="cuda")}
    shm = Path(tempfile.mkdtemp(prefix="ftrun-test-pin-", dir="/dev/shm"))
    try:
        with caplog.at_level(logging.WARNING, logger=pinning.__name__):
            pending = part_write.prepare_part(shm / "p", state, 1, keep_mapping=True)
            pending.commit()
        assert pending.kept_mapping is not None and pending.kept_mapping._pinned is None
        assert "cannot page-lock checkpoint memory" in caplog.text and pinning._disabled
        assert torch.ones(8, device="cuda").add_(1).sum().item() == 16.0
        loaded, _ = read_part(shm / "p")
        assert all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())
        del loaded
        pending.kept_mapping.close()
    finally:
        shutil.rmtree(shm)
