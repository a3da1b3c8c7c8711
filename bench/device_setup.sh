# Source this on the GPU device, from the repo root: `. bench/device_setup.sh`.
#
# The device has Python 3.12 and torch (CUDA) system-wide, no network and no ftrun install. This
# installs the wheels that `bench/device_wheels.sh` fetched here into /tmp/site, puts them and
# src/ on PYTHONPATH, and writes the launcher commands the benches call by path:
# .venv/bin/{python,ft_launcher,torchrun} and bench/.nvrx-venv/bin/{python,ft_launcher}, each the
# system interpreter running that launcher. Both folders are git-ignored and never carried.

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# Several NVRx launchers on one host (bench/restart/compare.py runs 2 per job).
export NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE=1
# One GPU, no NVLink peers: keep NCCL from probing for multicast (see the device's KINDS.md).
export NCCL_NVLS_ENABLE=0

_ftrun_wrapper() {  # path, python arguments
    mkdir -p "$(dirname "$1")"
    printf '#!/bin/sh\nexec %s %s "$@"\n' "$(command -v python3)" "$2" >"$1"
    chmod +x "$1"
}
_ftrun_wrapper .venv/bin/python ""
_ftrun_wrapper .venv/bin/ft_launcher "-m ftrun.ft_launcher.cli"
_ftrun_wrapper .venv/bin/torchrun "-m torch.distributed.run"
_ftrun_wrapper bench/.nvrx-venv/bin/python ""
_ftrun_wrapper bench/.nvrx-venv/bin/ft_launcher \
    "-c 'import sys; from nvidia_resiliency_ext.fault_tolerance.launcher import main; sys.exit(main())'"
unset -f _ftrun_wrapper
python3 -c 'import ftrun, nvidia_resiliency_ext, torch; print("device set up: torch", torch.__version__)'
