#!/usr/bin/env bash
# Download into .whl/ the wheels the GPU device needs for bench/restart/gpu_compare.py.
#
# The device (x86-64, Python 3.12, torch and numpy installed system-wide) has no network: every
# wheel travels in the working tree. Run from the repository root; .whl/ is kept out of git
# through .git/info/exclude (not .gitignore, which would be a change to the project). On the
# device:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
#
# Pinned, one version each: NVRx 0.7.0 (the peer); what its fault_tolerance launcher imports at
# start (grpcio, protobuf, defusedxml, httpx and its dependencies, sniffio which httpcore and
# anyio use when present, PyYAML, psutil, nvidia-ml-py); ftrun's runtime dependencies
# (pyproject.toml). protobuf stays on 6.x: NVRx's generated *_pb2 modules were made by protobuf
# 6.31.1 and check the runtime's major version.
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
touch "$exclude"
grep -qxF '/.whl/' "$exclude" || echo '/.whl/' >>"$exclude"

WHEELS=(
    # the peer and what its launcher imports
    nvidia-resiliency-ext==0.7.0
    grpcio==1.85.3
    protobuf==6.33.6
    defusedxml==0.7.1
    httpx==0.28.1
    httpcore==1.0.9
    h11==0.16.0
    anyio==4.16.0
    idna==3.20
    certifi==2026.10.19.post1
    sniffio==1.3.1
    typing_extensions==4.16.0
    # ftrun's runtime dependencies (NVRx shares psutil, PyYAML and nvidia-ml-py)
    pyzmq==27.3.0
    psutil==7.2.2
    click==8.5.1
    nvidia-ml-py==13.615.71
    msgpack==1.2.4
    PyYAML==6.0.4
    crc32c==2.9.post0
    prometheus_client==0.26.0
    # the etcd store and the scale bench (bench/rendezvous/rendezvous_scale.py --backend etcd,
    # which starts tests/etcd_cluster.py's members: pytest is imported there)
    etcd3gw==2.7.0
    futurist==3.5.0
    debtcollector==3.1.0
    wrapt==2.5.2
    pbr==7.1.3
    requests==2.34.2
    urllib3==2.8.0
    charset-normalizer==3.5.3
    pytest==9.2.0
    pluggy==1.7.0
    iniconfig==2.3.1
    packaging==26.4
    pygments==2.21.0
)

PLATFORMS=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_28 manylinux_2_27 \
    manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
PLATFORMS+=(--platform any)

mkdir -p .whl
for spec in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]}" -d .whl "$spec"
done
# The etcd server for the scale bench: this machine's (tests/etcd/install-etcd.sh installs it),
# a static binary; carry .etcd-bin and set FTRUN_ETCD=$PWD/.etcd-bin/etcd on the device.
mkdir -p .etcd-bin
cp "$(command -v etcd || echo /usr/bin/etcd)" .etcd-bin/etcd
grep -qxF '/.etcd-bin/' "$exclude" || echo '/.etcd-bin/' >>"$exclude"
ls -l .whl
du -sh .whl .etcd-bin
