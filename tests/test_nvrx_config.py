"""NVRx 0.7's configuration under ft_launcher: the YAML that NVRx's `to_yaml_file` writes, its
empty timeout values, and every flag of its launcher's parser, each honoured (warned about where
ftrun does it differently) or refused in one line by name; never "No such option".

The NVRx side is test data taken from the 0.7.0 release: tests/data/nvrx_0_7_ft_config.yaml
(what `FaultToleranceConfig().to_yaml_file()` writes) and tests/data/nvrx_0_7_launcher_flags.txt
(what `get_args_parser()` declares); each file says how it was made.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import yaml

from ftrun.errors import ConfigError, ExitCode
from ftrun.ft_launcher import cli
from ftrun.ft_launcher import values as v
from ftrun.ft_launcher.build import build_config
from ftrun.ft_launcher.command_line import parse_argv
from ftrun.ft_launcher.options import BY_NAME, OPTIONS
from launch import start_job

DATA = Path(__file__).resolve().parent / "data"
NVRX_YAML = DATA / "nvrx_0_7_ft_config.yaml"
NVRX_FLAGS = DATA / "nvrx_0_7_launcher_flags.txt"
LABEL_OF = {flag: opt.label for opt in OPTIONS for flag in (*opt.flags, *opt.off_flags)}


def nvrx_flags() -> list[tuple[tuple[str, ...], str | None]]:
    """(option strings, how NVRx's default is given: a value, "" or None for none, or "(flag)")."""
    rows = []
    for line in NVRX_FLAGS.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        if line.endswith(" (flag)"):
            rows.append((tuple(line.removesuffix(" (flag)").split()), "(flag)"))
            continue
        names, eq, value = line.partition(" =")
        rows.append((tuple(names.split()), value.strip() if eq else None))
    return rows


def nvrx_yaml_lines() -> list[str]:
    """The `key: value` lines of NVRx's section, spelled as NVRx writes them."""
    text = NVRX_YAML.read_text().splitlines()
    return [line.strip() for line in text if line.startswith("  ")]


def error_of(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        build_config(argv, {})
    message = str(info.value)
    assert "\n" not in message
    return message


# --- the YAML NVRx writes ----------------------------------------------------------------------


def test_nvrx_s_saved_yaml_is_accepted_and_honoured() -> None:
    config = build_config([f"--ft-cfg-path={NVRX_YAML}", "x.py"], {})
    monitor = config.monitor
    assert (monitor.initial_rank_heartbeat_timeout, monitor.rank_heartbeat_timeout) == (None, None)
    assert monitor.rank_out_of_section_timeout is None and dict(monitor.rank_section_timeouts) == {}
    assert (monitor.safety_factor, monitor.calculated_timeout_floor) == (5.0, 5.0)
    assert monitor.num_warmup_iterations == 5
    assert (config.health.nic, config.health.watch_interval, config.health.storage_paths) == (
        True, 5.0, ())  # fmt: skip
    agent = config.agent
    assert (agent.gpu_memory_reclaim_timeout, agent.gpu_memory_tolerance_mb) == (50.0, 512.0)
    assert (agent.max_no_progress_cycles, agent.termination_signal) == (3, signal.SIGKILL)
    assert config.log_level == "INFO"  # log_level: 20
    [warning] = config.warnings  # SIGKILL: NVRx's signal for the failed rank only
    assert "rank_termination_signal=SIGKILL" in warning and "SIGTERM" in warning


def test_each_field_nvrx_writes_is_accepted_alone_at_its_default(tmp_path: Path) -> None:
    lines = nvrx_yaml_lines()
    assert len(lines) == 34  # every field of NVRx 0.7's FaultToleranceConfig
    for line in lines:
        path = tmp_path / "one.yaml"
        path.write_text(f"fault_tolerance:\n  {line}\n")
        try:
            build_config([f"--ft-cfg-path={path}", "x.py"], {})
        except ConfigError as err:
            pytest.fail(f"NVRx's default {line!r} refused: {err}")


def test_other_values_of_refused_fields_are_refused_by_name(tmp_path: Path) -> None:
    keys = [line.partition(":")[0] for line in nvrx_yaml_lines()]
    refused = [BY_NAME[k] for k in keys if k in BY_NAME and BY_NAME[k].rejected]
    assert {opt.name for opt in refused} >= {"attribution_endpoint", "segment", "pci_topo_file"}
    path = tmp_path / "nvrx.yaml"
    for opt in refused:
        path.write_text(f"fault_tolerance:\n  {opt.yaml_key}: 7\n")  # 7: no field's default
        message = error_of(f"--ft-cfg-path={path}", "x.py")
        assert message == f"{path}: fault_tolerance.{opt.yaml_key}: not supported: {opt.rejected}"


def test_log_level_takes_nvrx_s_numbers_and_names() -> None:
    assert [v.log_level(n) for n in (10, 20, 30, 40, 50)] == list(v.LOG_LEVELS)
    # The lowest named level at or above the number lets through what the number does.
    assert (v.log_level(25), v.log_level("15"), v.log_level("dbg")) == ("WARNING", "INFO", "DEBUG")
    for bad in (5, 51, True, "verbose"):
        with pytest.raises(ValueError, match=r"or a number 10\.\.50"):
            v.log_level(bad)
    assert build_config(["--ft-log-level=20", "x.py"], {}).log_level == "INFO"


# --- empty values, as NVRx reads them ----------------------------------------------------------


def test_an_empty_timeout_is_none_as_in_nvrx() -> None:
    config = build_config(
        ["--ft-initial-rank-heartbeat-timeout=", "--ft-rank-heartbeat-timeout=",
         "--ft-rank_out_of_section_timeout=", "--ft-rank-section-timeouts=step:,save:30", "x.py"],
        {},
    )  # fmt: skip
    monitor = config.monitor
    assert (monitor.initial_rank_heartbeat_timeout, monitor.rank_heartbeat_timeout) == (None, None)
    assert monitor.rank_out_of_section_timeout is None
    assert dict(monitor.rank_section_timeouts) == {"step": None, "save": 30.0}
    assert dict(build_config(["--ft-rank-section-timeouts=", "x.py"], {}).monitor
                .rank_section_timeouts) == {}  # fmt: skip


def test_empty_values_elsewhere_are_none_or_refused_by_name() -> None:
    # NVRx's None default asks for nothing: its empty value is accepted.
    for flag in ("--ft-attribution-endpoint", "--ft-pci-topo-file", "--ft-cycle-info-dir",
                 "--ft-nvrx-logfile", "--ft-storage-health-check-path"):  # fmt: skip
        build_config([f"{flag}=", "x.py"], {})
    # NVRx reads these as None too, and then fails on it; ftrun says so at once, by name.
    for flag in ("--ft-workload-check-interval", "--ft-safety-factor",
                 "--ft-node-health-check-interval", "--ft-gpu-memory-reclaim-timeout",
                 "--ft-gpu-memory-tolerance-mb", "--ft-restart-check-interval",
                 "--ft-gpu-memory-poll-interval"):  # fmt: skip
        assert error_of(f"{flag}=", "x.py").startswith(f"{LABEL_OF[flag]}: ")


# --- NVRx's launcher flags ---------------------------------------------------------------------


def test_every_nvrx_0_7_launcher_flag_is_an_option() -> None:
    flags = nvrx_flags()
    assert len(flags) == 79 and (("--term-timeout", "--term_timeout"), "1800") in flags
    for names, default in flags:
        for flag in names:
            argv = [flag] if default == "(flag)" else [flag, default or "1"]
            try:
                line = parse_argv([*argv, "x.py", "--y"])
            except ConfigError as err:
                pytest.fail(f"{flag}: {err}")
            assert (line.script, line.script_args) == ("x.py", ("--y",)), flag


def test_nvrx_s_on_off_value_as_its_own_word() -> None:
    """NVRx's parser takes `--ft-enable-nic-healthcheck false` as well as `...=false`."""
    config = build_config(
        ["--ft-enable-nic-healthcheck", "TRUE", "--ft-gpu_health_check", "no", "x.py", "1"], {}
    )
    assert (config.health.nic, config.health.gpu) == (True, False)
    assert config.agent.entrypoint[-2:] == ("x.py", "1")


def test_nvrx_launcher_defaults_are_accepted_or_refused_by_name() -> None:
    refused = {}
    for names, default in nvrx_flags():
        if default is None or names[-1] == "--help":
            continue
        argv = [names[0]] if default == "(flag)" else [names[0], default]
        try:
            build_config([*argv, "x.py"], {})
        except ConfigError as err:
            assert str(err).startswith(f"{LABEL_OF[names[0]]}: not supported: "), str(err)
            refused[names[0]] = str(err)
    # NVRx's --term-timeout default (1800 s) is not ftrun's grace (15 s); the bare
    # --ft-ignore-missing-cfg asks for what ftrun does not do.
    assert set(refused) == {"--term-timeout", "--ft-ignore-missing-cfg"}


def test_term_timeout_is_accepted_where_it_is_ftrun_s_grace_and_refused_by_name_otherwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # NVRx's functional test scripts pass --term-timeout=15: ftrun's grace is 15 s already.
    assert build_config(["--term-timeout=15", "x.py"], {}).agent.workers_stop_timeout == 15
    both = build_config(["--term_timeout", "40", "--workers-stop-timeout=40", "x.py"], {})
    assert both.agent.workers_stop_timeout == 40
    message = error_of("--term-timeout=5", "x.py")
    assert message.startswith("--term-timeout: not supported: ") and "--workers-stop-timeout" in (
        message)  # fmt: skip
    with pytest.raises(SystemExit) as exited:
        cli.main(["--term-timeout=1800", "x.py"])
    assert exited.value.code == ExitCode.USAGE
    assert capsys.readouterr().err.count("\n") == 1


def test_nvrx_s_bare_ignore_missing_cfg_does_not_take_the_script() -> None:
    """NVRx's `--ft-ignore-missing-cfg` is a store_true flag; ftrun refuses it, by name."""
    message = error_of("--ft-ignore-missing-cfg", "x.py")
    assert message.startswith("--ft-ignore-missing-cfg: not supported: ")
    assert build_config(["--ft-ignore-missing-cfg=false", "x.py"], {}).agent.entrypoint[-1] == (
        "x.py")  # fmt: skip


def test_nvrx_s_no_restart_options_are_honoured(tmp_path: Path) -> None:
    agent = build_config(["--ft-attribution-stop-action", "No-Restart",
                          "--ft_no_restart_exit_code", "93", "x.py"], {}).agent  # fmt: skip
    assert (agent.attribution_stop_action, agent.no_restart_exit_code) == ("no-restart", 93)
    default = build_config(["x.py"], {}).agent
    assert (default.attribution_stop_action, default.no_restart_exit_code) == (None, None)
    path = tmp_path / "ft.yaml"
    for value, action in (("null", None), ("no-restart", "no-restart"), ("LOG", "log")):
        path.write_text(f"fault_tolerance:\n  attribution_stop_action: {value}\n")
        assert build_config([f"--ft-cfg-path={path}", "x.py"], {}).agent.attribution_stop_action \
            == action  # fmt: skip
    assert error_of("--ft-attribution-stop-action=stop", "x.py").startswith(
        "--ft-attribution-stop-action: expected one of log, no-restart")  # fmt: skip
    for taken in ("0", "1", "75", "200", "x"):  # success, relaunch me, preempted, a signal's
        assert error_of(f"--ft-no-restart-exit-code={taken}", "x.py").startswith(
            "--ft-no-restart-exit-code: ")  # fmt: skip


# --- one job ------------------------------------------------------------------------------------


@pytest.mark.process
def test_an_attribution_stop_ends_the_job_with_the_no_restart_exit_code(tmp_path: Path) -> None:
    """NVRx's two flags together: the first exception in the application stops the job (no
    restart left unspent matters), and the launcher exits NVRx's 93, not 6."""
    script = tmp_path / "bug.py"
    script.write_text("raise ValueError('a bug, not a fault')\n")
    flags = ["--max-restarts=5", "--ft-attribution-stop-action=no-restart",
             "--ft-no-restart-exit-code=93"]  # fmt: skip
    job = start_job(tmp_path, 1, flags, script=script)
    assert job.wait(60) == [93], job.nodes[0].text()[-3000:]
    [exit_event] = job.events("exit")
    assert exit_event["code"] == ExitCode.REPEATED_FAILURE
    assert "ValueError" in exit_event["why"] and "no-restart" in exit_event["why"]
    assert len(job.events("workers_started")) == 1  # no restart


@pytest.mark.process
def test_a_job_runs_with_nvrx_s_saved_yaml_unchanged(tmp_path: Path) -> None:
    assert yaml.safe_load(NVRX_YAML.read_text())["fault_tolerance"]["log_level"] == 20
    job = start_job(tmp_path, 1, [f"--ft-cfg-path={NVRX_YAML}"], ["--steps", "3"])
    assert job.wait(120) == [0], job.nodes[0].text()[-3000:]
    assert job.progress(0)[-1][1] == 3
