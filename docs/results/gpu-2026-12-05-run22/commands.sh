#!/usr/bin/env bash
# GPU run 22 as it ran (2026-12-05, one H200, main at b17a47f): docs/benchmarks.md "Run 22". vLLM 0.26.0 from the
# base wheel set (../shared/gpu/prepare-wheels --chunk-mb 46: 9 chunks).
# Calls 1-8, one chunk each (carry .vllm-gpu/chunks/partNN), ~4 s apart (the first waited ~90 s for the machine):
mkdir -p /root/stash && cp .vllm-gpu/chunks/part* /root/stash/ && ls /root/stash | wc -l
# Call 9 (carry part08, .vllm-gpu/bin and .whl): install (8 s), the steps in the background from a copy of the tree,
# then the first wait:
source .vllm-gpu/bin/device-install.sh || exit 1; rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  bash scripts/gpu/bg.sh start run22 bash -c 'cd /root/tree && STEPS="d b" SWEEP_USERS=1,16,64,128,192 bash scripts/gpu/run16.sh'
sleep 1; BG_TAIL=30 bash scripts/gpu/bg.sh wait run22 480; cat /root/res/host.txt | head -12
# Calls 10-11 waited and took each archive back (the second also what step b had written so far):
cd /root/tree; BG_TAIL=40 bash scripts/gpu/bg.sh wait run22 520; cp /root/part-*.tgz "$OUT"/ 2>/dev/null
tar czf "$OUT"/partial.tgz -C /root/res . 2>/dev/null; cp /root/bg/run22.log "$OUT"/
cd /root/tree; BG_TAIL=40 bash scripts/gpu/bg.sh wait run22 555; cp /root/part-b.tgz "$OUT"/ 2>/dev/null
tar czf "$OUT"/partial-b.tgz -C /root/res host.txt b 2>/dev/null; cp /root/bg/run22.log "$OUT"/
# What each step ran (run16.sh's case at b17a47f, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   d) BENCH_ARGS="--users 1,16,64,128,192 --arms baseline,adp --target-workers 8 --card-bytes 96G" $v sweep
#        -> sweep192/
#   b) BENCH_ARGS="--agents 1,4,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 8 --card-bytes 64G \
#        --offload-bytes 64G" $v agents   -> agents-1-4-8/
# 1,523 of 1,800 s of device time.
