"""How a launcher option is declared: `Option`, and the helpers that build torchrun's and the
fault-tolerance options (`options.py`) and NVRx's (`nvrx_options.py`) alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Option:
    """One launcher option and all the ways to set it."""

    name: str
    """Key of the parsed value in `Resolved.values` (torchrun's `dest`; ft options lose `ft_`)."""
    flags: tuple[str, ...]
    parse: Callable[[Any], Any]
    default: Any
    help: str
    env: str | None = None
    yaml_key: str | None = None
    is_flag: bool = False
    off_flags: tuple[str, ...] = ()
    """For an on/off pair: the flags that set it to False."""
    metavar: str = "VALUE"
    ignored: str | None = None
    """Accepted for torchrun compatibility and ignored (why); setting it logs a warning."""
    rejected: str | None = None
    """Not supported (why, and what to use instead); setting it is a usage error."""
    harmless: tuple[str, ...] = ()
    """For a rejected option: values (lower case) that ask for nothing ftrun lacks (NVRx's
    default, e.g. `enable_dist_storage_healthcheck: false`); given, they are accepted."""
    yaml_aliases: tuple[str, ...] = ()
    """Other YAML keys with the same meaning (NVRx's spelling of the field)."""
    same_as: str | None = None
    """For a rejected option: the name of ftrun's option that does what it asks where the two
    agree (NVRx's `--term-timeout` and `--workers-stop-timeout`); set to that option's value,
    it is accepted."""
    flag_value: str | None = None
    """For an option that takes a value: the value it has when given alone, as a flag (NVRx's
    `--ft-ignore-missing-cfg` is one); a value is then given with `=`."""

    @property
    def label(self) -> str:
        """The flag that names this option in messages (the first long one)."""
        return next(flag for flag in self.flags if flag.startswith("--"))

    @property
    def description(self) -> str:
        """The help with what happens when an ignored or rejected option is set."""
        if self.rejected:
            other = " to another value" if self.same_as else ""
            return f"{self.help} Not supported: {self.rejected}; setting it{other} is an error."
        if self.ignored:
            return f"{self.help} Accepted for torchrun compatibility and ignored: {self.ignored}."
        return self.help


def spellings(prefix: str, name: str) -> tuple[str, ...]:
    """`--dash-case`, torchrun's `--underscore_case`, and NVRx's mixed `--ft-under_score` (its
    launcher accepts `--ft-` followed by the config field's name)."""
    dashed = "--" + f"{prefix}{name}".replace("_", "-")
    underscored = "--" + f"{prefix}{name}".replace("-", "_")
    mixed = "--" + prefix.replace("_", "-") + name
    return tuple(dict.fromkeys((dashed, underscored, mixed)))


def torchrun_option(
    name: str, default: Any, parse: Callable[[Any], Any], help: str, **kw: Any
) -> Option:
    """A torchrun option: same flags, `PET_<NAME>` env var (unless `env=None`), no YAML key."""
    short = kw.pop("short", ())
    env = kw.pop("env", f"PET_{name.upper()}")
    return Option(name, (*short, *spellings("", name)), parse, default, help, env=env, **kw)


def ft_option(name: str, default: Any, parse: Callable[[Any], Any], help: str, **kw: Any) -> Option:
    """A fault-tolerance option: `--ft-<name>` flags and the YAML key `<name>`."""
    prefix = kw.pop("prefix", "ft_")
    yaml_key = name if kw.pop("in_yaml", True) else None
    aliases = tuple(kw.pop("aliases", ()))  # NVRx's names for the same field
    kw["off_flags"] = spellings(f"{prefix}no_", name) if kw.get("off_flags") else ()
    flags = tuple(f for n in (name, *aliases) for f in spellings(prefix, n))
    return Option(name, flags, parse, default, help, yaml_key=yaml_key, yaml_aliases=aliases, **kw)


def default_of(cls: type, field: str) -> Any:
    """A dataclass field's default, so that the config classes stay the one source of it."""
    for f in dataclasses.fields(cls):
        if f.name == field:
            return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    raise KeyError(field)
