"""The `ft_launcher` command line: torchrun's options plus fault tolerance, into one config.

`cli.main` is the console script; it is not imported here so that `python -m
ftrun.ft_launcher.cli` runs without a double-import warning.
"""

from ftrun.config.launch import LaunchConfig
from ftrun.ft_launcher.build import build_config
from ftrun.ft_launcher.options import OPTIONS, Option
from ftrun.ft_launcher.yaml_file import load_ft_yaml

__all__ = ["OPTIONS", "LaunchConfig", "Option", "build_config", "load_ft_yaml"]
