#!/usr/bin/env bash
# GPU run 19 as it ran (2026-12-04, one H200, main at 99ea5da): docs/benchmarks.md "Run 19". vLLM 0.33.0 from the
# 0.33 wheel set: scripts/gpu/requirements-vllm-0.33.0.txt packed by prepare-wheels with the manylinux_2_18_x86_64
# tag added to its platform list (nvidia-nccl-cu13 2.30.7 has only that wheel), --chunk-mb 46 --dest .vllm-gpu-033:
# 73 wheels, 60 chunks (a 50 MB chunk with the 16.7 MB tree is over a call's 64 MiB).
# Calls 1-60, one chunk each (carry .vllm-gpu-033/chunks/partNN):
mkdir -p /root/stash && cp .vllm-gpu-033/chunks/part* /root/stash/
# Call 61 (carry part59, .vllm-gpu-033/bin and .whl): install (40 s), then from a copy of the tree
source .vllm-gpu-033/bin/device-install.sh || exit 1; rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  STEPS="a v" bash scripts/gpu/bg.sh start run19 bash scripts/gpu/run16.sh   # a -> families-vllm033/, v -> agents16-card32g-vllm033/
bash scripts/gpu/bg.sh wait run19 540; cp /root/part-*.tgz "$OUT"/            # wait calls, back to back
# then (a first attempt failed at once: device-install.sh not sourced in that call)
source .vllm-gpu-033/bin/device-install.sh && cd /root/tree && STEPS="o" bash scripts/gpu/bg.sh start run19o2 \
  bash scripts/gpu/run16.sh                                                     # o -> agents1-cost-vllm033/
# What each step ran (run16.sh's case, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   a) versions.txt; $v gpu-unit (beside); GDN_ARGS="" FAMILY_JOBS=7 FAMILY_TIMEOUT=480 FAMILIES="mtp gdn mamba dsa mla
#      swa swa:mistral dense gdn+corrupt-states mamba+corrupt-states dsa+corrupt mla+corrupt swa+corrupt dense+corrupt"
#      $v families
#   v) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp --target-workers 8 --card-bytes 32G" $v agents
#   o) BENCH_ARGS="--agents 1 --turns 4 --arms baseline,adp --target-workers 8 --card-bytes 64G" $v agents
# One machine was lost early (a restart after ~3.5 min: the chunks sent again). ~1,490 of 1,800 s of device time.
