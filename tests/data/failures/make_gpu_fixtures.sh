#!/bin/sh
# Makes the GPU failure fixtures of tests/test_attribution.py on a CUDA machine (the device):
# each case runs as a user's script would and its stderr is kept as it was written.
#   sh tests/data/failures/make_gpu_fixtures.sh OUT_DIR
set -u
out=${1:?OUT_DIR}
mkdir -p "$out"
run() {  # name, python code
    printf '%s\n' "$2" >"$out/$1.py"
    python3 "$out/$1.py" 2>"$out/$1.txt"
    echo "$1: exit $?"
}
run cuda_oom 'import torch
def grow():
    return torch.empty(1 << 45, dtype=torch.uint8, device="cuda")
grow()'
run illegal_memory_access 'import torch
import triton
import triton.language as tl
@triton.jit
def poke(pointer, offset):
    tl.store(pointer + offset, 1.0)
def step(x):
    poke[(1,)](x, 1 << 40)
    torch.cuda.synchronize()
step(torch.zeros(16, device="cuda"))'
run device_assert 'import torch
def gather(x, i):
    y = x[i]
    torch.cuda.synchronize()
    return y
gather(torch.zeros(3, device="cuda"), torch.tensor([5], device="cuda"))'
cat >"$out/nccl_duplicate_gpu.py" <<'PY'
import os
import torch
import torch.distributed as dist
def main():
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
main()
PY
MASTER_ADDR=127.0.0.1 MASTER_PORT=29577 WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 \
    python3 "$out/nccl_duplicate_gpu.py" 2>"$out/nccl_duplicate_gpu_rank1.txt" &
MASTER_ADDR=127.0.0.1 MASTER_PORT=29577 WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 \
    timeout 120 python3 "$out/nccl_duplicate_gpu.py" 2>"$out/nccl_duplicate_gpu.txt"
echo "nccl_duplicate_gpu: exit $?"
wait
