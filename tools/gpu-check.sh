#!/usr/bin/env bash
# The GPU checks CI cannot run, in one pass of a few minutes on a machine with CUDA: the tests
# marked gpu, then the GPU benchmarks whose figures docs/benchmarks.md records. Runs bpsctl from
# this checkout (no install needed: torch with CUDA, numpy, pyzmq, rich, typer, psutil, pytest
# and pytest-timeout must be importable). Writes its JSON reports and traces under $OUT (default
# ./gpu-check), and prints each figure's command before it.
#
#   tools/gpu-check.sh            # everything (about 5 minutes on one GPU)
#   tools/gpu-check.sh tests      # only the tests
#   tools/gpu-check.sh bench      # only the benchmarks
#   tools/gpu-check.sh fusion     # the forced staged step at 4,096,000 / 16 / 32 / 64 MiB CUDA
#                                 # buckets, both models (about 5 minutes): the default's evidence
#   tools/gpu-check.sh parts      # the forced staged step of both models with one partition per
#                                 # bucket (BPSCTL_PARTITION_DEPTH=0, 64 MiB partitions) beside the
#                                 # defaults: what the engine's per-partition work costs a GPU step
#   tools/gpu-check.sh profiles   # `bpsctl profile` of both models at batch 64 of 224x224 (the
#                                 # recorded profiles that replace the shipped derived h200-*
#                                 # ones: copy them to bpsctl/bench/profiles/, about 1 minute)
#   tools/gpu-check.sh profile    # torch.profiler's view of the forced ResNet50 step at 4,096,000
#                                 # and 32 MiB CUDA buckets beside plain (tools/gpu-profile.py:
#                                 # the compute stream's idle gaps and what each thread did then)
#
# Every step has its own time limit (a hung step fails alone, the rest still run); the
# training benchmarks time 5 iterations of 5 batches after 5 warm-up batches, as Horovod's
# synthetic benchmark does in spirit, to keep the whole pass within a few minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
what=${1:-all}
python=${PYTHON:-python3}
bpsctl=("$python" -m bpsctl.cli --state-dir "$OUT/state")
status=0

step() {            # step NAME SECONDS COMMAND...: run it, say how long it took and how it ended
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*"
    local start=$SECONDS
    timeout -k 15 "$limit" "$@"; local code=$?
    echo "=== $name: exit $code after $((SECONDS - start)) s"
    [[ $code -eq 0 ]] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
"$python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'GPUs', torch.cuda.device_count(), 'NCCL', torch.cuda.nccl.version())"

if [[ $what == all || $what == tests ]]; then
    step tests 180 "$python" -m pytest -q -n 4 -p no:cacheprovider -rs --durations=15 \
        tests/test_torch_gpu.py tests/test_paths.py tests/test_staging.py tests/test_lend.py \
        tests/test_replay.py::test_recording_on_a_gpu_times_every_parameter_with_cuda_events
fi

if [[ $what == profiles ]]; then
    for model in resnet50 vgg16; do
        step "$model-recorded" 120 "${bpsctl[@]}" profile "$model" --device cuda \
            --batch-size 64 --image-size 224 -o "$OUT/h200-$model.json"
    done
fi

if [[ $what == all || $what == bench ]]; then
    steps=(--warmup 5 --iters 5 --batches-per-iter 5)
    for model in resnet50 vgg16; do
        # one GPU: bpsctl has nothing to sum and should match the plain row
        step "$model-1gpu" 90 "${bpsctl[@]}" bench "$model" --device cuda --workers 1 \
            "${steps[@]}" --compare ddp --json "$OUT/$model-1gpu.json"
    done
    for model in resnet50 vgg16; do
        # the staged path through one server, with a trace: where its time goes
        step "$model-forced" 100 env BPSCTL_FORCE_DISTRIBUTED=1 "${bpsctl[@]}" bench "$model" \
            --device cuda --workers 1 --servers 1 "${steps[@]}" --trace "$OUT/trace-$model" \
            --json "$OUT/$model-forced.json"
    done
    step comm-cuda 75 "${bpsctl[@]}" bench comm --device cuda --workers 1 --servers 1 \
        --size 256MiB --repeats 5 --json "$OUT/comm-cuda.json"
    step comm-tcp 75 env BPSCTL_SHM_SERVER=0 "${bpsctl[@]}" bench comm --workers 1 --servers 2 \
        --size 64MiB --json "$OUT/comm-tcp.json"
    # the same with one ZeroMQ I/O thread per process (auto gives a 16-core machine two)
    step comm-tcp-io1 75 env BPSCTL_SHM_SERVER=0 BPSCTL_IO_THREADS=1 "${bpsctl[@]}" bench comm \
        --workers 1 --servers 2 --size 64MiB --json "$OUT/comm-tcp-io1.json"
    for model in resnet50 vgg16; do
        [[ -d $OUT/trace-$model ]] && step "$model-trace" 30 "${bpsctl[@]}" trace \
            "$OUT/trace-$model" --json "$OUT/trace-$model.json"
    done
fi

if [[ $what == fusion ]]; then
    # BPSCTL_CUDA_FUSION_BYTES: the staged step of each model at each bound, plain beside it
    for bytes in 4096000 16777216 33554432 67108864; do
        for model in resnet50 vgg16; do
            step "$model-fusion-$bytes" 60 env BPSCTL_FORCE_DISTRIBUTED=1 \
                BPSCTL_CUDA_FUSION_BYTES=$bytes "${bpsctl[@]}" bench "$model" --device cuda \
                --workers 1 --servers 1 --warmup 3 --iters 3 --batches-per-iter 5 \
                --json "$OUT/$model-fusion-$bytes.json"
        done
    done
fi
if [[ $what == parts ]]; then
    for model in resnet50 vgg16; do
        for parts in default whole; do
            knobs=(BPSCTL_PARTITION_DEPTH=16)
            [[ $parts == whole ]] && knobs=(BPSCTL_PARTITION_DEPTH=0 BPSCTL_PARTITION_BYTES=64MiB)
            step "$model-parts-$parts" 60 env BPSCTL_FORCE_DISTRIBUTED=1 "${knobs[@]}" \
                "${bpsctl[@]}" bench "$model" --device cuda --workers 1 --servers 1 --warmup 3 \
                --iters 3 --batches-per-iter 5 --json "$OUT/$model-parts-$parts.json"
        done
    done
fi

if [[ $what == profile ]]; then
    for bytes in 4096000 33554432; do
        systems=plain,bpsctl
        [[ $bytes == 4096000 ]] || systems=bpsctl
        # the engine's own timeline of the same run beside torch's (bpsctl trace reads it)
        step "resnet50-profile-$bytes" 150 env BPSCTL_FORCE_DISTRIBUTED=1 \
            BPSCTL_CUDA_FUSION_BYTES=$bytes BPSCTL_TRACE_DIR="$OUT/profile-$bytes/trace" \
            "${bpsctl[@]}" run -np 1 -- "$python" tools/gpu-profile.py --model resnet50 \
            --systems $systems --out "$OUT/profile-$bytes"
        [[ -d $OUT/profile-$bytes/trace ]] && step "resnet50-profile-$bytes-trace" 30 \
            "${bpsctl[@]}" trace "$OUT/profile-$bytes/trace" \
            --json "$OUT/profile-$bytes/trace.json"
    done
fi
exit $status
