"""A fault-injecting file layer for tests (issue 54): the file system calls that code makes
under one directory, counted in order, and the Nth made to fail with a chosen errno (or, for
a raw write, to write only part of its bytes), as SQLite's test harness does at every call.

Not a mock of any tier: the code under test runs whole and really writes; only the one call
fails, as it would on a full or broken disk. Calls are intercepted at `os` and `open` (what
the checkpoint tiers, the events log and the status files use, DCP's writer included); a call
counts when its path lies under `root`, or its descriptor or file object was opened there.

    with FaultyFS(root) as fs:          # count
        save()
    for index in range(len(fs.calls)):
        with FaultyFS(root, fail_at=index, error=errno.ENOSPC):
            ...                         # the save meets the error at that call
"""

from __future__ import annotations

import builtins
import errno as errnos
import io
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHORT = -1
"""`error=SHORT`: the raw write at `fail_at` writes half its bytes and says so (not an error)."""
HANG = -2
"""`error=HANG`: the call at `fail_at` waits until `release` is set (a hung file system), then
goes on."""

# Calls that change the file system or what will be on it. Reads are not failed.
PATH_CALLS = ("mkdir", "replace", "rename", "unlink", "rmdir", "link")
FD_CALLS = ("write", "pwrite", "fsync", "fdatasync", "posix_fallocate", "ftruncate")
WRITES = ("write", "pwrite", "sendfile")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


class FaultyFS:
    def __init__(self, root: Path, fail_at: int | None = None, error: int = errnos.EIO) -> None:
        self.root = str(Path(root).resolve())
        self.fail_at, self.error = fail_at, error
        self.calls: list[tuple[str, str]] = []
        """(call, path) for every counted call, in order."""
        self.failed: tuple[str, str] | None = None
        self._fds: dict[int, str] = {}
        self._lock = threading.Lock()
        self._saved: dict[tuple[Any, str], Any] = {}
        self.release = threading.Event()

    def __enter__(self) -> FaultyFS:
        for name in PATH_CALLS:
            self._patch(os, name, self._path_call(name, getattr(os, name)))
        for name in FD_CALLS:
            self._patch(os, name, self._fd_call(name, getattr(os, name)))
        self._patch(os, "open", self._open_fd)
        self._patch(os, "close", self._close_fd)
        self._patch(os, "sendfile", self._sendfile)
        self._patch(builtins, "open", self._open_file)
        self._patch(io, "open", self._open_file)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()  # a call left hanging goes on
        for (module, name), original in self._saved.items():
            setattr(module, name, original)

    def _patch(self, module: Any, name: str, replacement: Callable[..., Any]) -> None:
        self._saved[(module, name)] = getattr(module, name)
        setattr(module, name, replacement)

    def _original(self, module: Any, name: str) -> Callable[..., Any]:
        return self._saved[(module, name)]

    def _under(self, path: Any) -> str | None:
        try:
            text = os.path.abspath(os.fspath(path))
        except TypeError:  # a descriptor, not a path
            return None
        return text if text == self.root or text.startswith(self.root + os.sep) else None

    def _count(self, call: str, path: str) -> int | None:
        """Record the call; the errno to fail it with (SHORT for a short write), or None."""
        with self._lock:
            index = len(self.calls)
            self.calls.append((call, path))
            if index != self.fail_at:
                return None
            if self.error == SHORT and call not in WRITES:
                return None  # only a raw write can be short
            self.failed = (call, path)
        if self.error == HANG:
            self.release.wait()
            return None
        return self.error

    def _raise(self, error: int, path: str) -> None:
        raise OSError(error, os.strerror(error), path)

    def _path_call(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            under = self._under(path)
            if under is not None and (error := self._count(name, under)) is not None:
                self._raise(error, under)
            return original(path, *args, **kwargs)

        return call

    def _fd_call(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(fd: int, *args: Any, **kwargs: Any) -> Any:
            path = self._fds.get(fd)
            if path is not None and (error := self._count(name, path)) is not None:
                if error == SHORT:
                    data = args[0]
                    return original(fd, data[: max(1, len(data) // 2)], *args[1:], **kwargs)
                self._raise(error, path)
            return original(fd, *args, **kwargs)

        return call

    def _sendfile(self, out: int, source: int, offset: Any, count: int) -> int:
        path = self._fds.get(out)
        if path is not None and (error := self._count("sendfile", path)) is not None:
            if error == SHORT:
                count = max(1, count // 2)
            else:
                self._raise(error, path)
        return self._original(os, "sendfile")(out, source, offset, count)

    def _open_fd(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        under = self._under(path)
        writing = under is not None and flags & WRITE_FLAGS
        if writing and (error := self._count("open", under)) is not None:
            self._raise(error, under)
        fd = self._original(os, "open")(path, flags, *args, **kwargs)
        if under is not None:
            self._fds[fd] = under
        return fd

    def _close_fd(self, fd: int) -> None:
        self._fds.pop(fd, None)
        self._original(os, "close")(fd)

    def _open_file(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        under = self._under(file)
        writing = any(flag in mode for flag in "wax+")
        if under is not None and writing and (error := self._count("open", under)) is not None:
            self._raise(error, under)
        handle = self._original(builtins, "open")(file, mode, *args, **kwargs)
        if under is None or not writing:
            return handle
        self._fds[handle.fileno()] = under  # an fsync of it counts
        return _FaultyFile(handle, self, under)


class _FaultyFile:
    """A file object whose writes, flushes and fsyncs count (and may fail)."""

    def __init__(self, handle: Any, fs: FaultyFS, path: str) -> None:
        self._handle, self._fs, self._path = handle, fs, path

    def write(self, data: Any) -> int:
        error = self._fs._count("file.write", self._path)
        if error is not None and error != SHORT:
            self._fs._raise(error, self._path)
        return self._handle.write(data)

    def flush(self) -> None:
        error = self._fs._count("file.flush", self._path)
        if error is not None and error != SHORT:
            self._fs._raise(error, self._path)
        self._handle.flush()

    def close(self) -> None:
        if not self._handle.closed:
            self._fs._fds.pop(self._handle.fileno(), None)
            self._handle.close()

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Any:
        return iter(self._handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)
