#!/usr/bin/env bash
# The GPU checks BENCHMARKS waits for ("The host out of the step"): prepared to run on a GPU machine in two short
# commands, each step under a timeout of its own so that one hang leaves the other's output.
#
#   bash bench/gpu_checks.sh fetch          # where PyPI is reached: the wheels a GPU machine may lack, into .whl
#   bash bench/gpu_checks.sh graphs         # on the GPU machine (.whl copied along), 4 minutes at most
#   bash bench/gpu_checks.sh throughput     # then 7 minutes at most: seconds, MFU, busy share, graphs on and off
#   bash bench/gpu_checks.sh                # both, in that order (without CUDA: their plumbing, tiny)
#
# Logs and the throughput's JSON go to $OUT where it is set, else /tmp/gpu_checks.
set -uo pipefail
cd "$(dirname "$0")/.."
# what a CUDA image with PyTorch, transformers, safetensors and peft (Python 3.12) lacks: torchao as
# requirements.txt pins it, diffusers as BENCHMARKS' earlier GPU runs had it
WHEELS="diffusers==0.42.1 torchao==0.18.0 importlib_metadata==8.7.0"

if [ "${1:-}" = fetch ]; then
    mkdir -p .git/info && { grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude; }
    # shellcheck disable=SC2086
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl $WHEELS
fi

parts=${1:-graphs throughput}
for part in $parts; do
    [[ $part == graphs || $part == throughput ]] || { echo "unknown part: $part (fetch, graphs or throughput)"; exit 2; }
done
out=${OUT:-/tmp/gpu_checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    if ls .whl/*.whl > /dev/null 2>&1; then  # the wheels `fetch` brought
        python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    fi
    graphs_flags=() throughput_flags=(--timeout 150) limits=(240 420)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/machine.txt"
else  # the plumbing only: eager against eager's automatic choice, and a narrow model's host-bound steps
    graphs_flags=(--steps 6 --modes 0 auto) throughput_flags=(--resolution 64 --cpu_width 8 --steps 3) limits=(900 1200)
fi
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/machine.txt"

step() {  # step SECONDS NAME COMMAND...: its output to $OUT/NAME.log and to the screen, then its exit code
    local seconds=$1 name=$2
    shift 2
    echo "== $name (at most $seconds s): $*"
    timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]}"
}

for part in $parts; do
    case $part in
        graphs)
            rm -rf /tmp/gpu_checks_graphs
            step "${limits[0]}" graphs python3 bench/bench_cuda_graphs.py --work /tmp/gpu_checks_graphs "${graphs_flags[@]}"
            rm -rf /tmp/gpu_checks_graphs ;;
        throughput)
            step "${limits[1]}" throughput python3 bench/bench_throughput.py "${throughput_flags[@]}" --json "$out/throughput.json" \
                --only lora_b1_none lora_b1_none_graph lora_b4_auto lora_b4_auto_graph lora_b4_auto_compile \
                lora_b4_auto_compile_graph lora_b1_all lora_b1_all_compile diffusers_b1_all sft_b1_auto_flat \
                sft_b1_auto_flat_graph ;;
    esac
done
