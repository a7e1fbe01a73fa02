#!/usr/bin/env bash
# GPU run 23 as it ran (2026-12-05, main at bddfa53). The device tool was asked for an H200 (kind nvidia-h200) and
# lent an H100 80GB HBM3 (16 cores, 125 GiB RAM, /dev/shm 128 GiB): every ratio below is between arms of this run on
# this machine; none is compared with an H200 figure. vLLM 0.26.0 from the base wheel set
# (../shared/gpu/prepare-wheels --chunk-mb 46: 9 chunks).
# Calls 1-8, one chunk each (carry .vllm-gpu/chunks/partNN):
mkdir -p /root/stash && cp .vllm-gpu/chunks/part* /root/stash/ && ls /root/stash | wc -l
# Call 9 (carry part08, .vllm-gpu/bin and .whl): install, the steps in the background from a copy of the tree, a wait:
source .vllm-gpu/bin/device-install.sh || exit 1; rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  bash scripts/gpu/bg.sh start run23 bash -c 'cd /root/tree && STEPS="b p q" bash scripts/gpu/run16.sh'
sleep 1; BG_TAIL=30 bash scripts/gpu/bg.sh wait run23 480
# Call 10: the rest of the wait, and the archives back:
cd /root/tree; BG_TAIL=25 bash scripts/gpu/bg.sh wait run23 540; cp /root/part-*.tgz "$OUT"/
# Calls 11-12 (the first found no vLLM: a new call's shell lacks device-install's environment): step p's baseline,
# the 192-user point alone with no connector, for the profiled point's ratio:
cd /root/tree && source .vllm-gpu/bin/device-install.sh && export TMPDIR=/dev/shm &&
  BENCH_ARGS="--users 192 --arms baseline --target-workers 8 --card-bytes 96G" \
  bash scripts/gpu/validate.sh sweep /root/res/p2 > /root/p2.log 2>&1
# What each step ran (run16.sh's case at bddfa53, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   b) BENCH_ARGS="--agents 1,4,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 8 --card-bytes 64G \
#        --offload-bytes 64G" $v agents                                              -> agents-1-4-8/
#   p) BENCH_ARGS="--users 192 --arms adp --target-workers 8 --card-bytes 96G --profile adp --profile-gil" \
#        $v sweep                                                                     -> sweep192-adp-gil-profile/
#   q) BENCH_ARGS="--users 1,16 --arms adp --target-workers 8 --card-bytes 96G --connector-opt save_spill_mb=24576" \
#        $v sweep                                                                     -> warmup-spill24g/
# The profile's split: python3 scripts/gpu/pyspy_connector_frames.py \
#   docs/results/gpu-2026-12-05-run23/sweep192-adp-gil-profile/logs/pyspy-adp-engine.txt.gz
# 1,495 of 1,800 s of device time.
