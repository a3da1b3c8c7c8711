"""The `ft_launcher` command line from the declared options (`options.py`): the click command
that parses it, `--help`, and each option's value by precedence, highest first: command line,
environment, YAML, default (`resolve`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import click
from click.core import ParameterSource

from ftrun.errors import ConfigError
from ftrun.ft_launcher import values as v
from ftrun.ft_launcher.declare import Option
from ftrun.ft_launcher.options import FT_OPTIONS, OPTIONS, PROG, YAML_SECTION


@dataclasses.dataclass(frozen=True)
class CommandLine:
    """What the command line itself says, before the environment, YAML and defaults."""

    given: Mapping[str, Any]
    """Raw values of the options present on the command line, by `Option.name`."""
    script: str | None
    script_args: tuple[str, ...]
    help: bool = False


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Every option's parsed value, its source ('cli', 'env', 'yaml', 'default') and its label."""

    values: Mapping[str, Any]
    sources: Mapping[str, str]
    labels: Mapping[str, str]
    """How to name where the value came from in a message (flag, env var or YAML key)."""

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def is_set(self, name: str) -> bool:
        """Whether the value was given somewhere rather than defaulted."""
        return self.sources[name] != "default"


def shown_default(opt: Option) -> str:
    """The default as `--help` and docs/options.md show it ("" when there is nothing to show)."""
    default = opt.default
    if opt.is_flag or opt.off_flags:
        return "on" if default else "off"
    if default is None:
        return "none" if opt.parse is v.timeout else ""
    if isinstance(default, (tuple, list)):
        return ",".join(str(getattr(item, "name", item)) for item in default)
    if isinstance(default, Mapping):
        return ",".join(f"{key}:{value}" for key, value in default.items())
    if isinstance(default, float):
        return f"{default:g}"
    return str(getattr(default, "name", default))


def _help_line(opt: Option) -> str:
    where = [f"env {opt.env}"] if opt.env else []
    where += [f"YAML {opt.yaml_key}"] if opt.yaml_key else []
    default = shown_default(opt)
    if default and default != "off":
        where.append(f"default {default}")
    return f"{opt.description} [{'; '.join(where)}]" if where else opt.description


def _click_param(opt: Option) -> click.Option:
    if opt.off_flags:
        pairs = [f"{on}/{off}" for on, off in zip(opt.flags, opt.off_flags, strict=True)]
        return click.Option([opt.name, *pairs], default=None, help=_help_line(opt))
    if opt.is_flag:
        return click.Option([opt.name, *opt.flags], is_flag=True, help=_help_line(opt))
    choices = getattr(opt.parse, "choices", None)
    metavar = "[" + "|".join(choices) + "]" if choices else opt.metavar
    return click.Option([opt.name, *opt.flags], type=str, metavar=metavar, help=_help_line(opt))


@functools.cache
def command() -> click.Command:
    """The click command derived from `OPTIONS` (parsing only; it runs nothing)."""
    params: list[click.Parameter] = [_click_param(opt) for opt in OPTIONS]
    params.append(click.Option(["help", "-h", "--help"], is_flag=True, help="Show this and exit."))
    params.append(click.Argument(["training_script"], required=False, metavar="SCRIPT"))
    params.append(click.Argument(["training_script_args"], nargs=-1, type=click.UNPROCESSED,
                                 metavar="[SCRIPT_ARGS]..."))  # fmt: skip
    return click.Command(
        PROG,
        params=params,
        add_help_option=False,
        # Stop at the script: everything after it belongs to the script, as with torchrun.
        context_settings={"allow_interspersed_args": False, "max_content_width": 100},
        help="Fault-tolerant drop-in for torchrun: run SCRIPT on every node, restart on failures.",
    )


_NVRX_BOOLEANS = frozenset({"1", "true", "yes", "0", "false", "no"})
"""The words NVRx's `str_to_bool` takes (any case): the value of an on/off option."""


def _with_nvrx_forms(argv: Sequence[str]) -> list[str]:
    """NVRx's launcher takes a value for its on/off options (`--ft-enable-nic-healthcheck=true`,
    or `... true`) where ftrun has a flag pair, and has bare flags where ftrun's option takes a
    value (`Option.flag_value`): before the script, each becomes the form ftrun's option takes."""
    booleans = {f: o for o in FT_OPTIONS if o.parse is v.boolean for f in o.flags}
    bare = {f: o.flag_value for o in OPTIONS if o.flag_value is not None for f in o.flags}
    takes_value = {
        f for o in OPTIONS if not (o.is_flag or o.off_flags or o.flag_value) for f in o.flags
    }
    args, i = list(argv), 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        flag, eq, value = args[i].partition("=")
        if not eq and flag in bare:
            args[i] = f"{flag}={bare[flag]}"
        nxt = args[i + 1] if i + 1 < len(args) else ""
        if not eq and flag in booleans and nxt.strip().lower() in _NVRX_BOOLEANS:
            args[i : i + 2] = [f"{flag}={nxt}"]  # NVRx's value as its own word
            continue
        if eq and flag in booleans:
            opt = booleans[flag]
            try:
                on = v.boolean(value)
            except ValueError as err:
                raise ConfigError(f"{flag}: {err}") from None
            off = opt.off_flags[:1] if opt.off_flags else ()  # without: off is the default
            args[i : i + 1] = [opt.label] if on else list(off)
            i += 1 if on or off else 0
            continue
        i += 2 if not eq and flag in takes_value else 1
    return args


def parse_argv(argv: Sequence[str]) -> CommandLine:
    """Split the command line into given option values, the script and its arguments."""
    try:
        ctx = command().make_context(PROG, _with_nvrx_forms(argv))
    except click.ClickException as err:
        raise ConfigError(" ".join(err.format_message().split())) from None
    given = {opt.name: ctx.params[opt.name] for opt in OPTIONS
             if ctx.get_parameter_source(opt.name) == ParameterSource.COMMANDLINE}  # fmt: skip
    params = ctx.params
    return CommandLine(given, params["training_script"], tuple(params["training_script_args"]),
                       bool(params["help"]))  # fmt: skip


def help_text() -> str:
    """`ft_launcher --help`."""
    cmd = command()
    return cmd.get_help(click.Context(cmd, info_name=PROG))


def _pick(
    opt: Option, line: CommandLine, environ: Mapping[str, str], yaml: Mapping[str, Any], origin: str
) -> tuple[Any, str, str]:
    """(raw value, source, label for messages) by precedence: CLI, env, YAML, default."""
    if opt.name in line.given:
        return line.given[opt.name], "cli", opt.label
    if opt.env and environ.get(opt.env, ""):
        return environ[opt.env], "env", opt.env
    for key in ((opt.yaml_key,) if opt.yaml_key else ()) + opt.yaml_aliases:
        if key in yaml:
            return yaml[key], "yaml", f"{origin}: {YAML_SECTION}.{key}"
    return opt.default, "default", opt.label


def resolve(
    line: CommandLine,
    environ: Mapping[str, str],
    yaml: Mapping[str, Any] | None = None,
    origin: str = "YAML",
) -> Resolved:
    """Parse every option from its highest-precedence source; a bad value is a `ConfigError`."""
    parsed: dict[str, Any] = {}
    sources: dict[str, str] = {}
    labels: dict[str, str] = {}
    for opt in OPTIONS:
        raw, sources[opt.name], labels[opt.name] = _pick(opt, line, environ, yaml or {}, origin)
        try:
            parsed[opt.name] = opt.parse(raw)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{labels[opt.name]}: {err}") from None
    return Resolved(values=parsed, sources=sources, labels=labels)
