#!/usr/bin/env bash
# The ADP release's 8-GPU runs (issue #8), on one 8-GPU host after the vLLM wheels are installed (the GPU
# machines have no network: the pinned wheels are carried in and installed with pip --no-index; that recipe is
# not part of this repository):   bash scripts/gpu/release8.sh OUTDIR
# 1. restart: one 200k-token prompt, Llama-3.1-70B shape, TP=8: baseline / cold / warm after an engine restart
# 2. agents: 1, 4, 8, 16 agents with 40-50k-token histories (the gpu preset), TP=8; baseline, cpu-offload, adp
# 3. sweep: 1..300 concurrent users (the gpu preset), TP=8; baseline and adp
# With fewer GPUs than TP (or DRY_RUN=1) it is a dry run: the restart plan is checked (TP divisibility, memory
# per GPU, card size: scripts/gpu/restart_ttft.py --dry-run) and every command is printed, not run.
set -euo pipefail
out=${1:?output directory}
tp=${TP:-8}
root=$(cd "$(dirname "$0")/../.." && pwd)
ngpu=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
dry=${DRY_RUN:-$([ "$ngpu" -ge "$tp" ] && echo 0 || echo 1)}
export PYTHONPATH="${PYTHONPATH:-}:$root/wire/src:$root/connector/src:$root/emulator/src:$root/testbed/src" PYTHONHASHSEED=0
mkdir -p "$out"
echo "release8: $ngpu GPU(s) here, TP=$tp, $([ "$dry" = 1 ] && echo "DRY RUN" || echo "running")"
run() { echo "+ $*"; if [ "$dry" = 0 ]; then "$@"; fi; }
restart=(python3 "$root/scripts/gpu/restart_ttft.py" --shape llama70b --tp "$tp" --lengths 200000
         --kv-cache-gb 60 --capacity 200G --out "$out/restart")
"${restart[@]}" --dry-run
run "${restart[@]}"
model=$(python3 "$root/scripts/gpu/restart_ttft.py" --model-only --shape llama70b --lengths 65536 --out "$out")
bench=(python3 -m adp_testbed.cli bench)
common=(--preset gpu --model "$model" --engine-arg=--load-format=dummy "--engine-arg=--tensor-parallel-size=$tp"
        --vllm-python python3)
run "${bench[@]}" agents "${common[@]}" --arms baseline,cpu-offload,adp --out "$out/agents"
run "${bench[@]}" sweep "${common[@]}" --arms baseline,adp --out "$out/sweep"
