#!/usr/bin/env bash
# GPU run 20 as it ran (2026-12-04, one H200, main at 6b5018b: frequency admission, the MTP group fix of 23798c9):
# docs/benchmarks.md "Run 20". vLLM 0.33.0 from the 0.33 wheel set, packed as in run 19 (prepare-wheels with the
# manylinux_2_18_x86_64 tag, --chunk-mb 46 --dest .vllm-gpu-033: 73 wheels, 60 chunks).
# Calls 1-59, one chunk each (carry .vllm-gpu-033/chunks/partNN), ~3.7 s apart:
mkdir -p /root/stash && cp .vllm-gpu-033/chunks/part* /root/stash/ && ls /root/stash | wc -l
# Call 60 (carry part59, .vllm-gpu-033/bin and .whl): install (36 s), then from a copy of the tree
source .vllm-gpu-033/bin/device-install.sh || exit 1; rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  STEPS="m v y" bash scripts/gpu/bg.sh start run20 bash scripts/gpu/run16.sh
cd /root/tree && bash scripts/gpu/bg.sh wait run20 420; cp /root/part-*.tgz "$OUT"/   # wait calls, back to back
cd /root/tree && bash scripts/gpu/bg.sh wait run20 470; cp /root/part-*.tgz "$OUT"/
cd /root/tree && source .vllm-gpu-033/bin/device-install.sh; STEPS="o" bash scripts/gpu/bg.sh start run20o \
  bash scripts/gpu/run16.sh; bash scripts/gpu/bg.sh wait run20o 420; cp /root/part-o.tgz "$OUT"/
# What each step ran (run16.sh's case, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   m) FAMILY_JOBS=2 FAMILIES="mtp mtp+corrupt" $v families     -> families-mtp-vllm033/ (mtp+corrupt is refused by
#      testbed verify at once: MTP's control is built in, the drafter's KV zeroed in a restore)
#   v) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp --target-workers 8 --card-bytes 32G" $v agents
#                                                               -> agents16-card32g-admission-frequency/ (the default)
#   y) the same with --connector-opt admission=always           -> agents16-card32g-admission-always/
#   o) BENCH_ARGS="--agents 1 --turns 4 --arms baseline,adp --target-workers 8 --card-bytes 64G" $v agents
#                                                               -> agents1-cost-vllm033/
# 1,294 s of device time to here.
# Then, at main 3037840 (docs only since 6b5018b), vLLM 0.26.0 from the base wheel set (prepare-wheels --chunk-mb 46:
# 9 chunks; calls 1-8 one chunk each as above, with .vllm-gpu/chunks/partNN), the last call carrying part08,
# .vllm-gpu/bin and .whl, in the foreground:
source .vllm-gpu/bin/device-install.sh || exit 1; STEPS=v timeout 380 bash scripts/gpu/run16.sh > /tmp/r.log 2>&1
cp /root/part-v.tgz "$OUT"/                                   # -> vllm026/agents16-card32g-admission-frequency/
# 1,539 of 1,800 s of device time in all.
