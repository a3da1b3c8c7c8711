#!/usr/bin/env bash
# The open issues' device measurements, one step a call (a call may run 10 minutes; the
# session's device time is 30): `bash bench/device_runs.sh STEP...` on the device, from the
# repository root, with `.whl` carried (and `.etcd-bin` for `scale`). Each step prints as it
# goes and leaves its raw results under $OUT. Steps, roughly in seconds on 4 x H200:
#   abort        (30)  NCCL's abort with and without the wake-ups (bench/restart/nccl_abort.py)
#   probe        (200) a restarted worker's phases, cold and prestarted; the store's race
#                      (bench/restart/cuda_standby_probe.py)
#   compile-probe (300) a compiled model's restart with warm caches: fresh, prestarted, with
#                      inductor preloaded (bench/restart/compile_restart_probe.py)
#   nccl-topo    (90)  NCCL's init timings, and NCCL's topology and graphs kept from a first
#                      round (cuda_standby_probe --modes warm,warm-topo) on every GPU
#   inprocess    (380) a raise and a SIGKILL, ftrun's wrapper beside NVRx's, 3 runs
#   inprocess-compile (350) a raise in a compiled model, the same, 3 runs
#   snapshot     (120) StepSnapshot's stall on the 151M DDP script and its FSDP2 variant
#                      (bench/goodput/stall.py), and its CUDA test
#   goodput      (3 x GOODPUT_S + start-ups) bench/goodput/goodput.py, 2 launchers x 2 GPUs
#                      where there are 4, else 1 x 1
#   gpu-tests    (310) tests/gpu on every GPU, then on one
#   compare-1-4  (500) gpu_compare, 1 and 4 GPUs a launcher, beside torchrun and NVRx
#   compare-1-2  (450) gpu_compare, 1 and 2 GPUs a launcher (the 2-GPU kind's widths)
#   compile-warm (500) gpu_compare, a compiled model's second job on one GPU, ftrun and torchrun
#   compare-2x2  (400) gpu_compare, two launchers x 2 GPUs
#   scale        (350) rendezvous rounds at 1,024 and 4,096 nodes, then 16,384, both stores
#   nvlink       (10)  the health watch's NVLink check once on every GPU: links, counters, verdict
#                      (bench/monitor/nvlink_check.py; "no NVLink" where the GPUs have none)
set -u
. bench/device_setup.sh >/dev/null || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
GPUS=$(nvidia-smi -L | wc -l)
echo "device: $GPUS GPUs, $(nproc) cores; tree: $(git log --oneline -1 2>/dev/null)"

for step in "$@"; do
    echo "=== $step ($(date +%T))"
    case "$step" in
    abort)
        timeout 90 python3 -m bench.restart.nccl_abort --rounds 8 2>&1 \
            | grep -E "round|median|before its first"
        ;;
    probe)
        timeout 30 python3 -m bench.restart.cuda_standby_probe --guard
        timeout 150 python3 -m bench.restart.cuda_standby_probe --ranks 1,4 --rounds 3 \
            | grep MEDIAN
        for store in rank0 hosted rank0 hosted; do
            timeout 60 python3 -m bench.restart.cuda_standby_probe --modes warm --ranks 4 \
                --rounds 2 --store "$store" | grep "ranks="
        done
        ;;
    compile-probe)
        timeout 400 python3 -m bench.restart.compile_restart_probe --rounds 3 --profile 2>&1 \
            | grep -vE "^[0-9.]+ rank=" | head -150
        ;;
    nccl-topo)
        NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT timeout 150 python3 -m \
            bench.restart.cuda_standby_probe --ranks "$GPUS" --rounds 4 --modes warm,warm-topo \
            2>&1 | grep -E "MEDIAN|ranks=|Init timings" | head -60
        ;;
    inprocess | inprocess-compile)
        cases=raise:plain,kill:plain
        [[ $step == inprocess ]] || cases=raise:compile
        timeout 560 python3 -m bench.restart.inprocess_compare --nproc "$GPUS" --cases "$cases" \
            --contenders ftrun-inprocess-peer-dev,nvrx-inprocess-peer-dev --runs 3 \
            --budget-s 480 --json "$OUT/$step.json" --markdown 2>&1 | grep -E "run [0-9]|\|"
        ;;
    snapshot)
        for variant in "" --fsdp2; do
            timeout 150 python3 -m bench.goodput.stall $variant 2>&1 | tail -4
        done
        timeout 120 python3 -m pytest tests/gpu/test_snapshot_gpu.py -m gpu -p no:cacheprovider -q \
            2>&1 | tail -2
        ;;
    goodput)
        # 3 settings x GOODPUT_S (default 150 s, to fit a call; the issue asks 600 s); 2 launchers
        # x 2 GPUs where there are 4, else one launcher x one GPU (no lost node).
        layout=1x1
        ((GPUS >= 4)) && layout=2x2
        timeout "${GOODPUT_LIMIT:-590}" python3 -m bench.goodput.goodput --device cuda \
            --d-model 1024 --layers 12 --batch 8 --seq 512 --layout "${GOODPUT_LAYOUT:-$layout}" \
            --duration "${GOODPUT_S:-150}" --every "${GOODPUT_EVERY:-60}" --pg-timeout 120 \
            --settings "${GOODPUT_SETTINGS:-torchrun,nvrx-local,ft-snapshot}" \
            --json "$OUT/goodput.json" --markdown 2>&1 | grep -vE "^\s*$"
        ;;
    gpu-tests)
        FTRUN_GPU_REPORT="$OUT/gpu-all.json" timeout 420 python3 -m pytest tests/gpu -m gpu \
            --timeout 200 -p no:cacheprovider -rA 2>&1 | grep -E "^(PASSED|FAILED|ERROR)|^E |passed|failed"
        FTRUN_GPU_REPORT="$OUT/gpu-one.json" CUDA_VISIBLE_DEVICES=0 timeout 140 python3 -m pytest \
            tests/gpu -m gpu --timeout 120 -p no:cacheprovider 2>&1 | tail -1
        ;;
    compare-1-4)
        timeout 560 python3 -m bench.restart.gpu_compare --runs 1 --settings omp1 \
            --variants plain --layouts 1,4 --json "$OUT/compare-1-4.json" --markdown --check
        ;;
    compare-1-2)
        timeout 560 python3 -m bench.restart.gpu_compare --runs 1 --settings omp1 \
            --variants plain --layouts 1,2 --json "$OUT/compare-1-2.json" --markdown --check
        ;;
    compile-warm)
        timeout 560 python3 -m bench.restart.gpu_compare --runs 1 --settings omp1 \
            --variants compile-warm --launchers ftrun,torchrun --layouts 1 \
            --json "$OUT/compile-warm.json" --markdown --check
        ;;
    compare-2x2)
        timeout 560 python3 -m bench.restart.gpu_compare --runs 1 --settings omp1 \
            --variants plain --layouts 2,2x2 --json "$OUT/compare-2x2.json" --markdown --check
        ;;
    scale)
        export FTRUN_ETCD=$PWD/.etcd-bin/etcd
        ulimit -n "$(ulimit -Hn)"
        timeout 330 python3 -m bench.rendezvous.rendezvous_scale --nodes 1024,4096 \
            --impl barrier --backend both --repeats 1 --cap 60 --threads-per-proc 64 \
            --keep-going --floor-calls 50 --floor-blocks 2 2>&1 | grep -v "does not answer"
        timeout 240 python3 -m bench.rendezvous.rendezvous_scale --nodes 16384 --impl barrier \
            --backend both --repeats 1 --cap 150 --threads-per-proc 128 --keep-going \
            --floor-calls 0 2>&1 | grep -v "does not answer" | tail -40
        ;;
    nvlink)
        timeout 60 python3 -m bench.monitor.nvlink_check --seconds 5
        ;;
    *)
        echo "unknown step: $step" >&2
        exit 2
        ;;
    esac
done
