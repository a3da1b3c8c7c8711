"""The rendezvous part of the launcher's config: where the nodes meet (torchrun's backends and
endpoints, `--standalone`, static), `--rdzv-conf`, and the timeouts; notes for what is ignored.
"""

from __future__ import annotations

import difflib
import importlib.util
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

from ftrun.config.rendezvous import RendezvousConfig, RendezvousImpl
from ftrun.errors import ConfigError
from ftrun.ft_launcher import values as v
from ftrun.ft_launcher.command_line import Resolved

MASTER_PORT = 29500
"""torchrun's --master-port default (static rendezvous)."""
C10D_PORT = 29400
"""torchrun's c10d rendezvous port when --rdzv-endpoint names none."""
ETCD_PORT = 2379
"""etcd's client port, when an --rdzv-endpoint member names none."""
LOCAL_STORE = "127.0.0.1:0"
"""--standalone: a store on this host, on a port the OS picks."""
_CONF_TIMEOUTS = ("join_timeout", "last_call_timeout", "close_timeout")
_CONF_TORCH_ONLY = ("heartbeat_timeout", "keep_alive_interval", "keep_alive_max_attempt",
                    "store_type", "timeout")  # fmt: skip
"""--rdzv-conf keys that torch's c10d/static rendezvous reads and ftrun's does not."""
_CONF_KNOWN = (*_CONF_TIMEOUTS, "is_host", "read_timeout", *_CONF_TORCH_ONLY)


class _Meeting(NamedTuple):
    backend: str
    endpoint: str
    run_id: str
    node_rank: int | None
    local: bool
    """A store on this host on a free port (--standalone, or torchrun's one-node default)."""


def rendezvous_config(opts: Resolved, notes: list[str]) -> RendezvousConfig:
    min_nodes, max_nodes = opts["nnodes"]
    meeting = _meeting_point(opts, max_nodes, notes)
    if meeting.local:
        min_nodes = max_nodes = 1
    impl = RendezvousImpl(opts["rdzv_impl"])
    conf = dict(opts["rdzv_conf"])
    label = opts.labels["rdzv_conf"]
    _check_conf_keys(conf, label, notes)
    timeouts = {key: _conf_value(conf, key, v.positive_number, label) for key in _CONF_TIMEOUTS}
    is_host = _conf_value(conf, "is_host", v.boolean, label)
    if "read_timeout" in conf:
        conf["read_timeout"] = str(_conf_value(conf, "read_timeout", v.positive_number, label))
    if timeouts["close_timeout"] is not None and impl is not RendezvousImpl.DYNAMIC:
        notes.append(f"{label} close_timeout is only used by --ft-rdzv-impl=dynamic; ignored")
    if is_host is not None and meeting.local:
        notes.append(f"{label} is_host is ignored: this node serves its own local store")
    reconnect = opts["store_reconnect_timeout"]
    if reconnect > 0 and (meeting.local or meeting.backend == "etcd"):
        where = "a local store" if meeting.local else "etcd, which no node serves"
        notes.append(f"{opts.labels['store_reconnect_timeout']} ignored: the store is {where}")
        reconnect = 0.0
    elif reconnect > 0 and is_host:
        raise ConfigError(
            f"{label} is_host=true and {opts.labels['store_reconnect_timeout']}: with a reconnect "
            "window the store is `ftrun store`'s, and no agent serves it"
        )
    return RendezvousConfig(
        endpoint=meeting.endpoint, run_id=meeting.run_id, min_nodes=min_nodes,
        max_nodes=max_nodes, impl=impl, backend=meeting.backend,
        is_host=True if meeting.local else is_host, store_reconnect_timeout=reconnect,
        use_infra_group_rank=opts["use_infra_group_rank"], node_rank=meeting.node_rank,
        local_addr=opts["local_addr"], conf=MappingProxyType(conf),
        **{key: value for key, value in timeouts.items() if value is not None},
    )  # fmt: skip


def _check_conf_keys(conf: Mapping[str, str], label: str, notes: list[str]) -> None:
    """Unknown --rdzv-conf keys are errors (a typo would do nothing); torch's keys that ftrun's
    rendezvous does not read get a warning."""
    for key in conf:
        if key in _CONF_TORCH_ONLY:
            notes.append(f"{label} {key}: read by torch's rendezvous, not ftrun's; ignored")
        elif key not in _CONF_KNOWN:
            hint = difflib.get_close_matches(key, _CONF_KNOWN, n=1)
            guess = f"did you mean {hint[0]}? " if hint else ""
            raise ConfigError(
                f"{label}: unknown key {key!r} ({guess}known: {', '.join(_CONF_KNOWN)})"
            )


def _conf_value(conf: dict[str, str], key: str, parse: Callable[[Any], Any], label: str) -> Any:
    """Take `key` out of the --rdzv-conf pairs, parsed; None when absent."""
    if key not in conf:
        return None
    try:
        return parse(conf.pop(key))
    except ValueError as err:
        raise ConfigError(f"{label} {key}: {err}") from None


def _ignored(opts: Resolved, names: Sequence[str], why: str, notes: list[str]) -> None:
    """A warning naming those of `names` that were set although `why` makes them moot."""
    given = [opts.labels[name] for name in names if opts.is_set(name)]
    if given:
        notes.append(f"{', '.join(given)} ignored: {why}")


def _meeting_point(opts: Resolved, max_nodes: int, notes: list[str]) -> _Meeting:
    """Backend, store endpoint, run id and node rank, decided the way torchrun decides them."""
    local = _Meeting("c10d", LOCAL_STORE, str(uuid.uuid4()), None, local=True)
    if opts["standalone"]:
        if max_nodes > 1:
            raise ConfigError(
                f"--standalone runs one node, but {opts.labels['nnodes']} asks for more"
            )
        names = ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr", "master_port")
        _ignored(opts, (*names, "node_rank"), "--standalone uses a local store", notes)
        return local
    backend, endpoint = opts["rdzv_backend"], opts["rdzv_endpoint"]
    if backend == "static" and not endpoint and not opts.is_set("master_port") and max_nodes == 1:
        # torchrun >= 2.5 does the same: one static node needs no fixed port
        why = "one static node without --master-port uses a local store"
        _ignored(opts, ("rdzv_id", "master_addr", "node_rank"), why, notes)
        return local
    if not opts["rdzv_id"]:
        raise ConfigError(f"{opts.labels['rdzv_id']}: must not be empty")
    if backend == "static":
        label = opts.labels["rdzv_endpoint"] if endpoint else "--master-addr/--master-port"
        if endpoint:
            _ignored(opts, ("master_addr", "master_port"), f"{label} names the store", notes)
        port = opts["master_port"] if opts["master_port"] is not None else MASTER_PORT
        address = _endpoint(endpoint or v.format_endpoint(opts["master_addr"], port), None, label)
        if opts["node_rank"] >= max_nodes:
            raise ConfigError(
                f"{opts.labels['node_rank']}: {opts['node_rank']} is not below the node count"
                f" ({max_nodes})"
            )
        return _Meeting(backend, address, opts["rdzv_id"], opts["node_rank"], local=False)
    why = "only used with --rdzv-backend=static"
    _ignored(opts, ("node_rank", "master_addr", "master_port"), why, notes)
    if backend == "etcd":
        if importlib.util.find_spec("etcd3gw") is None:
            raise ConfigError("--rdzv-backend=etcd needs etcd3gw: pip install 'ftrun[etcd]'")
        members = [m for m in (endpoint or "localhost").split(",") if m.strip()]
        label = opts.labels["rdzv_endpoint"]
        address = ",".join(_endpoint(member, ETCD_PORT, label) for member in members)
        return _Meeting(backend, address, opts["rdzv_id"], None, local=False)
    address = _endpoint(endpoint or "localhost", C10D_PORT, opts.labels["rdzv_endpoint"])
    return _Meeting(backend, address, opts["rdzv_id"], None, local=False)


def _endpoint(raw: str, default_port: int | None, label: str) -> str:
    try:
        return v.format_endpoint(*v.endpoint(raw, default_port))
    except ValueError as err:
        raise ConfigError(f"{label}: {err}") from None
