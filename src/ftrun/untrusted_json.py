"""JSON that another process, file or user wrote: every malformation is a `ValueError`.

`json.loads` raises `ValueError` for bad text (`JSONDecodeError`, `UnicodeDecodeError`), but
`RecursionError` for nesting past its parser's depth (`[` a hundred thousand times), which a
reader that catches `ValueError` would let through as a traceback. Every reader of bytes it did
not write itself (a wire, the store, a part's header, a log) parses them here.
"""

from __future__ import annotations

import json
from typing import Any


def loads(raw: str | bytes | bytearray) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
