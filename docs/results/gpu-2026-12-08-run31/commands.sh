#!/usr/bin/env bash
# GPU run 31 as it ran (2026-12-08, after midnight; the tree of 014b2d5, unchanged: 155fedf's queued restore starts).
# Asked for nvidia-h200 from 23:24 UTC: eleven calls got no machine (eight refused starts at ~90 s each, three calls
# made while none was tried at 15 s each: 766 s of the session's 1,800 s); the twelfth, at 00:24, was lent one
# NVIDIA H100 80GB HBM3 (81,559 MiB, driver 580.159.04), 16 cores, 125 GiB RAM, kernel 6.18.44-fc-v1272-gpu: host.txt.
# Not an H200: these figures are no H200 claim (the gates ask for one). Too little time was left for G (~14 min), so
# W and o ran, then R twice more. vLLM 0.26.0 from the base wheel set (../shared/gpu/prepare-wheels --chunk-mb 40:
# 10 chunks). 136 s of device time were left at the end.
# Calls 1-9, one chunk each (carry .vllm-gpu/chunks/partNN):
mkdir -p /root/stash && cp .vllm-gpu/chunks/part* /root/stash/ && ls /root/stash | wc -l
# Call 10 (carry part09, .vllm-gpu/bin and .whl): install, W then o in the background from a copy of the tree:
source .vllm-gpu/bin/device-install.sh || exit 1; rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  bash scripts/gpu/bg.sh start run31 bash -c 'cd /root/tree && STEPS="W o" bash scripts/gpu/run16.sh' &&
  sleep 5 && BG_TAIL=40 bash scripts/gpu/bg.sh wait run31 480; cp /root/part-*.tgz "$OUT"/    # restart-1/, agents1-cost/
# Call 11 forgot device-install.sh (no vllm on the path: every engine failed at import, nothing measured), so
# calls 12 and 13 ran R again, each (carry .vllm-gpu/bin):
source .vllm-gpu/bin/device-install.sh || exit 1; cd /root/tree && rm -f /root/part-*.tgz && rm -rf /root/res/R &&
  bash scripts/gpu/bg.sh start run31c bash -c 'cd /root/tree && STEPS="R" bash scripts/gpu/run16.sh' &&
  sleep 5 && bash scripts/gpu/bg.sh wait run31c 330; cp /root/part-*.tgz "$OUT"/         # restart-2/, restart-3/
# What the steps ran (run16.sh, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   W) RESTART_ARGS="--lengths 32000,100000 --target-workers 8 --arms baseline,adp-cold,adp-warm \
#        --warm-variant b24:restore_batches=24 --warm-variant b48:restore_batches=48" $v restart    -> restart-1/
#   o) BENCH_ARGS="--agents 1 --turns 4 --arms baseline,adp --target-workers 8 --card-bytes 64G" $v agents
#                                                                                                 -> agents1-cost/
#   R) RESTART_ARGS="--lengths 32000,100000 --target-workers 8 --arms baseline,adp-cold,adp-warm" $v restart
#                                                                                       -> restart-2/, restart-3/
