#!/usr/bin/env bash
# The GPU checks BENCHMARKS waits for ("The host out of the step"), prepared as short commands for a GPU machine,
# each step under a time limit of its own so that one hang leaves the others' output; the most wanted first.
#
#   bash bench/gpu_checks.sh fetch        # where PyPI is reached: the wheels a GPU machine may lack, into .whl/
#   bash bench/gpu_checks.sh graphs       # on the GPU machine (.whl/ beside it): each stage graphed vs eager, <= 5 min
#   bash bench/gpu_checks.sh throughput   # seconds a step, MFU, GPU busy share; graphs on and off, <= 6 min
#   bash bench/gpu_checks.sh compile      # compiled blocks at batch 4 and every block recomputed, <= 5 min
#   bash bench/gpu_checks.sh              # all three, in that order (without CUDA: their plumbing, tiny)
#
# Logs and the bench's JSON go to $GPU_CHECKS_OUT (default /tmp/gpu_checks). Exit status: the last failed step's.
set -uo pipefail
cd "$(dirname "$0")/.."
# what a CUDA image with PyTorch, transformers, safetensors and peft (Python 3.12) lacks: torchao as
# requirements.txt pins it, diffusers as BENCHMARKS' earlier GPU runs had it
WHEELS="diffusers==0.42.1 torchao==0.18.0 importlib_metadata==8.7.0"

if [ "${1:-}" = fetch ]; then
    # shellcheck disable=SC2086
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl $WHEELS
fi

parts=${*:-graphs throughput compile}
for part in $parts; do
    case $part in
        graphs | throughput | compile) ;;
        *) echo "unknown part: $part (fetch, graphs, throughput or compile)"; exit 2 ;;
    esac
done
out=${GPU_CHECKS_OUT:-/tmp/gpu_checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    if ls .whl/*.whl > /dev/null 2>&1; then  # the wheels `fetch` brought
        python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    fi
    graphs_flags=(--steps 20) bench_flags=(--steps 6) limits=(300 360 300) row=(90 150)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/machine.txt"
else  # the plumbing only: eager against eager's automatic choice, and a narrow model's host-bound steps
    graphs_flags=(--steps 6 --modes 0 auto) bench_flags=(--resolution 64 --cpu_width 8 --steps 3)
    limits=(900 1200 900) row=(600 600)
fi
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/machine.txt"

status=0
step() {  # step SECONDS NAME COMMAND...: its output to $out/NAME.log and to the screen; a failure kept in $status
    local seconds=$1 name=$2
    shift 2
    echo "== $name (at most $seconds s): $*"
    timeout -k 20 "$seconds" "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    echo "== $name: exit $code"
    [ "$code" = 0 ] || status=$code
}

for part in $parts; do
    case $part in
        graphs)
            rm -rf /tmp/gpu_checks_graphs
            step "${limits[0]}" graphs python3 bench/bench_cuda_graphs.py --work /tmp/gpu_checks_graphs "${graphs_flags[@]}"
            rm -rf /tmp/gpu_checks_graphs ;;
        throughput)
            step "${limits[1]}" throughput python3 bench/bench_throughput.py "${bench_flags[@]}" --timeout "${row[0]}" \
                --json "$out/throughput.json" --only lora_b1_none lora_b1_none_graph lora_b4_auto lora_b4_auto_graph \
                sft_b1_auto_flat sft_b1_auto_flat_graph lora_b1_all diffusers_b1_all ;;
        compile)
            step "${limits[2]}" compile python3 bench/bench_throughput.py "${bench_flags[@]}" --timeout "${row[1]}" \
                --json "$out/compile.json" --only lora_b4_auto_compile lora_b4_auto_compile_graph lora_b1_all_compile ;;
    esac
done
exit $status
