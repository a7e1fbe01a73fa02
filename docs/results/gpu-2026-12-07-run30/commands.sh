#!/usr/bin/env bash
# GPU run 30 as it ran (2026-12-07, night; the tree of 637df33, unchanged).
# Asked for nvidia-h200 five times: four refused starts (631 s of device time) and a pause in lending; then lent one
# NVIDIA H100 80GB HBM3 (81,559 MiB, driver 580.159.04), 16 cores, 125 GiB RAM, kernel 6.18.44-fc-v1272-gpu: host.txt.
# Not an H200: these figures are no H200 claim (the gates ask for one). vLLM 0.26.0 from the base wheel set:
# ../shared/gpu/prepare-wheels --chunk-mb 40 (10 chunks). 1,710 s of the session's 1,800 s of device time in all.
# Calls 1-9, one chunk each (carry .vllm-gpu/chunks/partNN):
mkdir -p /root/stash && cp .vllm-gpu/chunks/part* /root/stash/ && ls /root/stash | wc -l
# Call 10 (carry part09, .vllm-gpu/bin and .whl): install, the steps in the background from a copy of the tree:
source .vllm-gpu/bin/device-install.sh || exit 1; rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  bash scripts/gpu/bg.sh start run30 bash -c 'cd /root/tree && STEPS="G W" bash scripts/gpu/run16.sh' &&
  sleep 5 && BG_TAIL=40 bash scripts/gpu/bg.sh wait run30 480; cp /root/part-*.tgz "$OUT"/
# Call 11, back to back (the device time ran out during W: only its baseline engine finished):
cd /root/tree && BG_TAIL=30 bash scripts/gpu/bg.sh wait run30 430; cp /root/part-*.tgz "$OUT"/
tar czf "$OUT"/partial.tgz -C /root res bg/run30.log                                     # run30.log, restart-partial/
# What the steps ran (run16.sh, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   G) BENCH_ARGS="--agents 16 --history-len 30000 --turns 6 --arms adp,cpu-offload,baseline --target-workers 8 \
#        --card-bytes 96G --offload-bytes 16G" $v agents                                  -> agents16-small-tier-30k-6turns/
#   W) RESTART_ARGS="--lengths 32000,100000 --target-workers 8 --arms baseline,adp-cold,adp-warm \
#        --warm-variant b24:restore_batches=24 --warm-variant b48:restore_batches=48" $v restart
#                                                                                         -> restart-partial/ (baseline only)
