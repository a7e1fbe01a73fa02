#!/usr/bin/env bash
# GPU run 25 as it ran (2026-12-06, main at e62969c). Asked with no kind, then nvidia-h200 and nvidia-h100-x1 while
# none was lent (seven refused starts, ~9 minutes of device time); lent an H100 80GB HBM3 (16 cores, 125 GiB RAM,
# /dev/shm 128 GiB): every ratio below is between arms of this run on this machine; none is compared with an H200
# figure. vLLM 0.26.0 from the base wheel set (../shared/gpu/prepare-wheels --chunk-mb 42: 9 chunks; at 50 MB a chunk
# and the checkout were over 64 MiB).
# Calls 1-8, one chunk each (carry .vllm-gpu/chunks/partNN):
mkdir -p /root/stash && cp .vllm-gpu/chunks/part* /root/stash/ && ls /root/stash | wc -l
# Call 9 (carry part08, .vllm-gpu/bin and .whl): install, the steps in the background from a copy of the tree, a wait:
source .vllm-gpu/bin/device-install.sh || exit 1; rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  bash scripts/gpu/bg.sh start run25 bash -c 'cd /root/tree && STEPS="b z" bash scripts/gpu/run16.sh'
sleep 1; BG_TAIL=30 bash scripts/gpu/bg.sh wait run25 560; cp /root/part-*.tgz "$OUT"/
# Call 10: the rest of the wait, and the archives back:
cd /root/tree; BG_TAIL=12 bash scripts/gpu/bg.sh wait run25 270; cp /root/part-*.tgz "$OUT"/
# What each step ran (run16.sh's case at e62969c, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm,
# A8="--agents 8 --turns 4 --target-workers 8 --card-bytes 64G"):
#   b) BENCH_ARGS="--agents 1,4,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 8 --card-bytes 64G \
#        --offload-bytes 64G" $v agents                                              -> agents-1-4-8/
#   z) BENCH_ARGS="$A8 --arms adp --connector-opt read_ahead_mb=0" $v agents         -> agents8-no-read-ahead/
# 1,564 of 1,800 s of device time (the refused starts included).
