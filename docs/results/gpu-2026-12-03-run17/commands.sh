#!/usr/bin/env bash
# GPU run 17 as it ran (2026-12-03, one H200, main at 5771583): docs/benchmarks.md "Run 17". After the 8 chunks of the
# base wheel set (.vllm-gpu/, one call each), one call started scripts/gpu/run16.sh in the background from a copy of
# the tree, then wait calls collected /root/part-*.tgz (c -> agents16-small-tier/, l -> agents16-ceiling/,
# o -> agents1-cost/, d -> sweep128/):
source .vllm-gpu/bin/device-install.sh && rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  STEPS="c l o d" bash scripts/gpu/bg.sh start run16 bash scripts/gpu/run16.sh
bash scripts/gpu/bg.sh wait run16 540; cp /root/part-*.tgz "$OUT"/    # three times
# What each step ran (run16.sh's case, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   c) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp,cpu-offload,baseline --target-workers 8
#        --card-bytes 96G --offload-bytes 16G" $v agents
#   l) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms baseline --kv-cache-bytes 80G" $v agents
#   o) BENCH_ARGS="--agents 1 --turns 4 --arms baseline,adp --target-workers 8 --card-bytes 64G" $v agents
#   d) BENCH_ARGS="--users 1,16,64,128 --arms baseline,adp --target-workers 8" $v sweep
