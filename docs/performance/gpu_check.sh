#!/usr/bin/env bash
# shardcheck's GPU path on a lent GPU machine (docs/performance.md, "The GPU path"): install the wheel built here,
# then three CUDA runs, each under its own limit: world 1 (one GPU: nccl) then a bf16 --bench, beside the quick
# matrix at world sizes 1, 2, 4 (gloo on the shared GPU).  What each printed, and its run folder without tensors,
# land in $OUT.  Here first:  mkdir -p .gpucheck && pip wheel --no-deps --no-build-isolation . -w .gpucheck
# (.gpucheck in .git/info/exclude); then the device's run of `bash docs/performance/gpu_check.sh`, carrying .gpucheck.
set -u
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
REPO=$PWD
W=/tmp/gpuw
mkdir -p $W && cd $W
{
    date -u; nvidia-smi -L; nproc
    python3 -c "import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.device_count())"
    python3 -c "import torch; print(torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"
} >$OUT/env.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile $REPO/.gpucheck/shardcheck-*.whl >>$OUT/env.txt 2>&1

step() { # name, limit in seconds, the run's arguments
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s.%N)
    timeout -k 10 $limit python3 -c 'import sys; from shardcheck.harness.cli import console; sys.argv[0] = "shardcheck"; sys.exit(console())' \
        run --no-progress --out $W/$name "$@" >$OUT/$name.log 2>&1
    local rc=$?
    echo "$name rc=$rc wall=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))") args=$*" >>$OUT/steps.txt
}
(
    step ws1_nccl 110 --device cuda --world-sizes 1 --quick
    step bench_bf16 130 --device cuda --quick --bench --suite model_utils,kd_loss --world-sizes 1,2
) &
step quick_gloo_gpu 255 --device cuda --quick
wait
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >>$OUT/env.txt 2>&1
tar czf $OUT/runs.tgz --exclude='*.pt' --exclude='*.npz' --exclude='*.png' --exclude='plan*/*.jsonl' */ 2>/dev/null
