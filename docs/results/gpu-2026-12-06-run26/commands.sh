#!/usr/bin/env bash
# GPU run 26 as it ran (2026-12-06, main at 5218af3). Asked with no kind; lent an H100 80GB HBM3 (16 cores, 125 GiB
# RAM, /dev/shm 128 GiB): every ratio is between arms of this run on this machine. vLLM 0.26.0 from the base wheel set
# (../shared/gpu/prepare-wheels --chunk-mb 42: 9 chunks).
# Calls 1-8, one chunk each (carry .vllm-gpu/chunks/partNN):
mkdir -p /root/stash && cp .vllm-gpu/chunks/part* /root/stash/ && ls /root/stash | wc -l
# Call 9 (carry part08, .vllm-gpu/bin and .whl): install, the steps in the background from a copy of the tree, a wait:
source .vllm-gpu/bin/device-install.sh || exit 1; rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  bash scripts/gpu/bg.sh start run26 bash -c 'cd /root/tree && STEPS="u b j c" bash scripts/gpu/run16.sh'
sleep 1; BG_TAIL=30 bash scripts/gpu/bg.sh wait run26 540; cp /root/part-*.tgz "$OUT"/
tar czf "$OUT"/partial.tgz -C /root/res .; cp /root/bg/run26.log "$OUT"/
# Calls 10-12 (carry .vllm-gpu/bin): the rest of the wait (420, 330 and 240 s), the same copies back. Call 11 ended
# with `pkill -f run16.sh`, which matched its own shell: it returned nothing, the steps went on, call 12 fetched them.
cd /root/tree; BG_TAIL=12 bash scripts/gpu/bg.sh wait run26 420; cp /root/part-*.tgz "$OUT"/
tar czf "$OUT"/partial.tgz -C /root/res .; cp /root/bg/run26.log "$OUT"/
# What each step ran (run16.sh's case at 5218af3, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm,
# A8="--agents 8 --turns 4 --target-workers 8 --card-bytes 64G"):
#   u) $v gpu-unit                                                                   -> gpu-unit/
#   b) BENCH_ARGS="--agents 1,4,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 8 --card-bytes 64G \
#        --offload-bytes 64G" $v agents                                              -> agents-1-4-8/
#   j) BENCH_ARGS="$A8 --arms adp --profile adp --profile-idle" $v agents            -> agents8-profiled/
#   c) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp,cpu-offload,baseline --target-workers 8 \
#        --card-bytes 96G --offload-bytes 16G" $v agents                             -> agents16-20k/
# 1,680 of 1,800 s of device time.
