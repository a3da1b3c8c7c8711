"""Value parsers for `ft_launcher` options.

Each takes a raw value as it arrives from the command line or the environment (a `str`) or from
the YAML file (a `str`, number, bool, `None`, list or mapping) and returns the typed value, or
raises `ValueError` with a short message that quotes the bad value. The caller
(`command_line.resolve`) prefixes the message with where the value came from (flag, env var or
YAML key).
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Callable, Mapping
from typing import Any

NONE_WORDS = frozenset({"none", "null"})
_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})
_HOST_RE = re.compile(r"^[\w.:-]+$")
_UNHANDLEABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LEVEL_NUMBERS = (10, 20, 30, 40, 50)  # logging's numbers of LOG_LEVELS, in the same order


def text(raw: Any) -> str:
    """Any scalar as a string (YAML may give a number where a name is meant)."""
    if isinstance(raw, (list, dict)) or raw is None:
        raise ValueError(f"expected a string, got {raw!r}")
    return str(raw)


def optional_text(raw: Any) -> str | None:
    """A string, or `None` when absent or empty."""
    return None if raw is None or raw == "" else text(raw)


def boolean(raw: Any) -> bool:
    """true/false, 1/0, yes/no, on/off (any case), or a YAML bool."""
    if isinstance(raw, bool):
        return raw
    word = str(raw).strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"expected true/false or 1/0, got {raw!r}")


def integer(raw: Any) -> int:
    """A whole number (a YAML bool is not one)."""
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
        raise ValueError(f"expected an integer, got {raw!r}")
    try:
        return int(str(raw).strip()) if not isinstance(raw, (int, float)) else int(raw)
    except ValueError:
        raise ValueError(f"expected an integer, got {raw!r}") from None


def number(raw: Any) -> float:
    """A finite real number."""
    if isinstance(raw, bool):
        raise ValueError(f"expected a number, got {raw!r}")
    try:
        value = float(raw if isinstance(raw, (int, float)) else str(raw).strip())
    except ValueError:
        raise ValueError(f"expected a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {raw!r}")
    return value


def _bounded(parse: Callable[[Any], Any], positive: bool) -> Callable[[Any], Any]:
    """`parse`, then a check that the value is > 0 (`positive`) or >= 0."""

    def parse_bounded(raw: Any) -> Any:
        value = parse(raw)
        if value < 0 or (positive and value == 0):
            raise ValueError(f"must be {'>' if positive else '>='} 0, got {raw!r}")
        return value

    return parse_bounded


non_negative_int = _bounded(integer, positive=False)
positive_number = _bounded(number, positive=True)
non_negative_number = _bounded(number, positive=False)


def timeout(raw: Any) -> float | None:
    """Seconds > 0, or none/null/an empty value (YAML null too) to switch that check off (NVRx
    reads `--ft-rank-heartbeat-timeout=` and `step:` in section timeouts as None)."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in (*NONE_WORDS, "")):
        return None
    try:
        return positive_number(raw)
    except ValueError:
        raise ValueError(f"expected a positive number of seconds or 'none', got {raw!r}") from None


def section_timeouts(raw: Any) -> dict[str, float | None]:
    """`name:seconds,name:seconds` (seconds may be `none`), or a YAML mapping name -> seconds."""
    if raw is None:
        return {}
    if isinstance(raw, Mapping):
        items = list(raw.items())
    else:
        items = []
        for part in filter(None, (p.strip() for p in text(raw).split(","))):
            name, sep, seconds = part.rpartition(":")
            if not sep or not name.strip():
                raise ValueError(f"expected name:seconds[,name:seconds...], got {raw!r}")
            items.append((name.strip(), seconds))
    result: dict[str, float | None] = {}
    for name, seconds in items:
        if not isinstance(name, str) or not name:
            raise ValueError(f"section names must be non-empty strings, got {name!r}")
        try:
            result[name] = timeout(seconds)
        except ValueError as err:
            raise ValueError(f"section {name!r}: {err}") from None
    return result


def nnodes(raw: Any) -> tuple[int, int]:
    """`N` or `MIN:MAX` with 1 <= MIN <= MAX (torchrun's `parse_min_max_nnodes` plus checks)."""
    parts = str(raw).split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        low, high = integer(parts[0]), integer(parts[-1])
    except ValueError:
        raise ValueError(f"expected N or MIN:MAX, got {raw!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= MIN <= MAX, got {raw!r}")
    return low, high


def nproc(raw: Any) -> int | str:
    """A count >= 1, or one of torchrun's device words, resolved later (`config.count_devices`)."""
    word = str(raw).strip().lower()
    if word in ("auto", "cpu", "gpu", "xpu"):
        return word
    try:
        value = integer(raw)
    except ValueError:
        raise ValueError(f"expected an integer >= 1 or auto/cpu/gpu/xpu, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"must be >= 1, got {raw!r}")
    return value


def std_spec(raw: Any) -> int | dict[int, int]:
    """torchrun's redirect/tee syntax: `3` (every local rank) or `0:1,1:2` (per local rank)."""
    word = str(raw).strip()
    if re.fullmatch(r"[0-3]", word):
        return int(word)
    if re.fullmatch(r"(\d+:[0-3],)*\d+:[0-3]", word):
        pairs = (item.split(":") for item in word.split(","))
        return {int(rank): int(flags) for rank, flags in pairs}
    raise ValueError(f"expected 0-3 or LOCAL_RANK:0-3[,...] (e.g. 3 or 0:1,1:2), got {raw!r}")


def rank_set(raw: Any) -> frozenset[int] | None:
    """`0,1,2` -> {0, 1, 2}; empty means no filter (`None`)."""
    if raw is None or str(raw).strip() == "":
        return None
    try:
        return frozenset(non_negative_int(part) for part in str(raw).split(","))
    except ValueError:
        raise ValueError(
            f"expected comma-separated local ranks (e.g. 0,1,2), got {raw!r}"
        ) from None


def comma_list(raw: Any) -> tuple[str, ...]:
    """torchrun's comma list: `a,b`, with `,,` standing for a literal comma; a YAML list too."""
    if raw is None or raw == "":
        return ()
    if isinstance(raw, (list, tuple)):
        return tuple(text(item) for item in raw)
    placeholder = "\0"
    items = text(raw).replace(",,", placeholder).split(",")
    return tuple(item.replace(placeholder, ",") for item in items)


def path_list(raw: Any) -> tuple[str, ...]:
    """`a,b` or a YAML list of paths; empty items are dropped."""
    items = raw if isinstance(raw, (list, tuple)) else ([] if raw is None else text(raw).split(","))
    return tuple(p for p in (text(item).strip() for item in items) if p)


def module_list(raw: Any) -> tuple[str, ...]:
    """`a,b.c` or a YAML list of importable module names; `none` means no modules."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "null", "")):
        return ()
    names = path_list(raw)
    bad = [n for n in names if not all(part.isidentifier() for part in n.split("."))]
    if bad:
        raise ValueError(f"not a module name: {bad[0]!r}")
    return names


def rdzv_conf(raw: Any) -> dict[str, str]:
    """`k=v,k=v` (torchrun's `_parse_rendezvous_config`: every key needs a value)."""
    result: dict[str, str] = {}
    body = text(raw).strip() if raw is not None else ""
    for item in body.split(",") if body else ():
        key, _, value = item.partition("=")
        if not key.strip() or not value.strip():
            raise ValueError(f"expected key=value[,key=value...], got {raw!r}")
        result[key.strip()] = value.strip()
    return result


def signal_value(raw: Any) -> signal.Signals:
    """A signal as SIGTERM, TERM or 15 (any case)."""
    word = str(raw).strip().upper()
    try:
        if word.isdigit():
            return signal.Signals(int(word))
        return signal.Signals[word if word.startswith("SIG") else f"SIG{word}"]
    except (KeyError, ValueError):
        raise ValueError(f"unknown signal {raw!r}") from None


def signal_list(raw: Any) -> tuple[signal.Signals, ...]:
    """Comma-separated signals that the launcher can catch and forward (not KILL or STOP)."""
    items = raw if isinstance(raw, (list, tuple)) else text(raw).split(",")
    result = tuple(signal_value(item) for item in items if str(item).strip())
    bad = [sig.name for sig in result if sig in _UNHANDLEABLE]
    if bad:
        raise ValueError(f"{', '.join(bad)} cannot be handled")
    return result


def log_level(raw: Any) -> str:
    """A logging level name (any case; WARN, and NVRx's DBG, too), or a number 10..50 as NVRx's
    `to_yaml_file` writes it (`log_level: 20`): the name of the lowest level at or above it,
    which lets through exactly what the number does (every message has a named level)."""
    word = str(raw).strip().upper()
    word = {"WARN": "WARNING", "DBG": "DEBUG"}.get(word, word)
    if word in LOG_LEVELS:
        return word
    numeric = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    if numeric is None and word.isdigit():
        numeric = int(word)
    if numeric is not None and _LEVEL_NUMBERS[0] <= numeric <= _LEVEL_NUMBERS[-1]:
        return LOG_LEVELS[next(i for i, n in enumerate(_LEVEL_NUMBERS) if n >= numeric)]
    raise ValueError(f"expected one of {', '.join(LOG_LEVELS)} or a number 10..50, got {raw!r}")


def choice(*choices: str, aliases: Mapping[str, str] | None = None) -> Callable[[Any], str]:
    """A parser accepting exactly `choices` (plus `aliases` -> canonical choice)."""
    alias_map = dict(aliases or {})

    def parse(raw: Any) -> str:
        word = str(raw).strip()
        word = alias_map.get(word, word)
        if word not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {raw!r}")
        return word

    parse.__doc__ = f"One of {', '.join((*choices, *alias_map))}."
    parse.choices = choices  # type: ignore[attr-defined]  # shown as the metavar in --help
    return parse


def optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`parse`, letting `None` (absent) through."""

    def parse_optional(raw: Any) -> Any:
        return None if raw is None else parse(raw)

    parse_optional.choices = getattr(parse, "choices", None)  # type: ignore[attr-defined]
    return parse_optional


def endpoint(raw: str, default_port: int | None) -> tuple[str, int]:
    """`host[:port]` or `[v6addr][:port]` -> (host, port); port 0..65535."""
    value = raw.strip()
    if value.startswith("[") and value.endswith("]"):
        host, port_text = value, ""
    else:
        host, _, port_text = value.rpartition(":") if ":" in value else (value, "", "")
    host = host[1:-1] if len(host) > 1 and host[0] == "[" and host[-1] == "]" else host
    if not host or not _HOST_RE.match(host):
        raise ValueError(f"expected host:port, got {raw!r}")
    if not port_text:
        if default_port is None:
            raise ValueError(f"no port in {raw!r}; use host:port")
        return host, default_port
    return host, port(port_text)


def port(raw: Any) -> int:
    """A TCP port 0..65535 (0: pick a free one)."""
    try:
        value = integer(raw)
    except ValueError:
        raise ValueError(f"expected a port number 0..65535, got {raw!r}") from None
    if not 0 <= value <= 65535:
        raise ValueError(f"expected a port number 0..65535, got {raw!r}")
    return value


def optional_port(raw: Any) -> int | None:
    """A port, or None for absent or `none` (off)."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none")):
        return None
    return port(raw)


def format_endpoint(host: str, port_number: int) -> str:
    """The inverse of `endpoint`: brackets around an IPv6 host."""
    return f"[{host}]:{port_number}" if ":" in host else f"{host}:{port_number}"


_NOT_NO_RESTART = frozenset({0, 1, 2, 5, 16, 75})
"""Exit codes that tell the scheduler something else (success, relaunch me, usage, excluded)."""


def no_restart_exit_code(raw: Any) -> int:
    """An exit status 3..125 other than 5, 16 and 75 (ftrun's codes that ask for a relaunch or
    mean something else)."""
    code = integer(raw)
    if not 3 <= code <= 125 or code in _NOT_NO_RESTART:
        raise ValueError(f"expected 3..125 but not 5, 16 or 75, got {raw!r}")
    return code


_STOP_ACTIONS = choice("log", "no-restart")


def attribution_stop_action(raw: Any) -> str | None:
    """log or no-restart, any case; None for none or empty (NVRx's YAML writes null)."""
    word = "" if raw is None else str(raw).strip().lower()
    return None if word in ("", "none", "null") else _STOP_ACTIONS(word)


attribution_stop_action.choices = _STOP_ACTIONS.choices  # type: ignore[attr-defined]
