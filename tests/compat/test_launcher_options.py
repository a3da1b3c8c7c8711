"""NVRx 0.7's launcher options and YAML keys under ft_launcher: honoured with NVRx's meaning,
or refused in one line that names ftrun's replacement."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.errors import ConfigError, ExitCode
from ftrun.ft_launcher import cli
from ftrun.ft_launcher.build import build_config
from ftrun.ft_launcher.nvrx_options import NVRX_OPTIONS


def test_nvrx_mixed_spellings_are_accepted() -> None:
    """NVRx's launcher takes `--ft-` + the config field's name (`--ft-initial_rank_...`)."""
    config = build_config(
        ["--ft-initial_rank_heartbeat_timeout=5", "--ft-rank_section_timeouts=step:3",
         "--ft-workload_check_interval=2", "--ft-no-gpu_health_check", "x.py"], {}
    )  # fmt: skip
    assert config.monitor.initial_rank_heartbeat_timeout == 5
    assert dict(config.monitor.rank_section_timeouts) == {"step": 3}
    assert config.monitor.calculated_timeout_floor == 2


def test_every_nvrx_only_option_is_refused_in_one_line_naming_a_replacement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NeMo/NVRx command line or YAML stops with one line that says what to use instead."""
    for opt in NVRX_OPTIONS:
        with pytest.raises(ConfigError) as err:
            build_config([f"{opt.label}=7", "x.py"], {})  # 7: no option's NVRx default
        assert str(err.value) == f"{opt.label}: not supported: {opt.rejected}"
        assert "\n" not in str(err.value) and len(opt.rejected or "") > 20
    yaml = tmp_path / "nvrx.yaml"
    yaml.write_text("fault_tolerance:\n  segment: 4\n")
    with pytest.raises(SystemExit) as exited:
        cli.main([f"--ft-cfg-path={yaml}", "x.py"])
    assert exited.value.code == ExitCode.USAGE
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "--nnodes=MIN:MAX" in err_lines[0], err_lines


def test_nvrx_s_storage_healthcheck_path_is_ftrun_s_storage_check(tmp_path: Path) -> None:
    """NVRx runs its path check whenever `storage_healthcheck_path` is given: so does ftrun."""
    yaml = tmp_path / "nvrx.yaml"
    yaml.write_text("fault_tolerance:\n  storage_healthcheck_path: /lustre,/home\n")
    config = build_config([f"--ft-cfg-path={yaml}", "x.py"], {})
    assert [str(p) for p in config.health.storage_paths] == ["/lustre", "/home"]
    flag = build_config(["--ft-storage_healthcheck_path=/scratch", "x.py"], {})
    assert [str(p) for p in flag.health.storage_paths] == ["/scratch"]


def test_nvrx_boolean_values_before_the_script_only() -> None:
    """NVRx writes `--ft-enable-nic-healthcheck=true`; the script's own arguments are its own."""
    config = build_config(
        ["--nnodes", "1", "--ft-enable-nic-healthcheck=true", "--ft-gpu_health_check=false",
         "--ft-use-infra-group-rank=0", "x.py", "--ft-gpu-health-check=true"], {}
    )  # fmt: skip
    assert (config.health.nic, config.health.gpu) == (True, False)
    assert config.agent.entrypoint[-1] == "--ft-gpu-health-check=true"
    with pytest.raises(ConfigError, match=r"^--ft-enable-nic-healthcheck: expected true/false"):
        build_config(["--ft-enable-nic-healthcheck=maybe", "x.py"], {})


def test_an_nvrx_config_spelling_out_nvrx_s_defaults_is_accepted(tmp_path: Path) -> None:
    """NVRx's own YAMLs list its defaults (`enable_dist_storage_healthcheck: false`, ...):
    they ask for nothing ftrun lacks, so they are accepted; asking for the feature is not."""
    yaml = tmp_path / "nvrx.yaml"
    yaml.write_text(
        "fault_tolerance:\n  enable_dist_storage_healthcheck: false\n  segment: null\n"
        "  restart_check_interval: 60.0\n  skip_section_response: true\n"
        "  restart_policy: any-failed\n"
    )
    build_config([f"--ft-cfg-path={yaml}", "x.py"], {})
    with pytest.raises(ConfigError, match="--ft-enable-dist-storage-healthcheck: not supported"):
        build_config([f"--ft-cfg-path={yaml}", "--ft-enable-dist-storage-healthcheck=true",
                      "x.py"], {})  # fmt: skip
