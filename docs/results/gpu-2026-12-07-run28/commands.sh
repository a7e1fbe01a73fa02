#!/usr/bin/env bash
# GPU run 28 as it ran (2026-12-07; steps C and R from the tree of 2166be5, the restore path from eb8c9fd).
# Asked for nvidia-h200 and nvidia-h100-x1: four refused starts cost 466 s of the session's 1,800 s. Then lent one
# NVIDIA H200 (143,771 MiB, driver 580.159.04), 16 cores, 125 GiB RAM, kernel 6.18.44-fc-v1294-gpu (Firecracker):
# host.txt. vLLM 0.26.0 from the base wheel set: ../shared/gpu/prepare-wheels --chunk-mb 40 (10 chunks: the checkout
# is 21 MB now, so a 50 MB chunk with it is over the 64 MiB a call carries). 849 s of device time on the machine.
# Calls 1-9, one chunk each (carry .vllm-gpu/chunks/partNN):
mkdir -p /root/stash && cp .vllm-gpu/chunks/part* /root/stash/ && ls /root/stash | wc -l
# Call 10 (carry part09, .vllm-gpu/bin and .whl): install, the steps in the background from a copy of the tree, a wait:
source .vllm-gpu/bin/device-install.sh || exit 1; rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  bash scripts/gpu/bg.sh start run28 bash -c 'cd /root/tree && STEPS="E C R F" bash scripts/gpu/run16.sh'
sleep 1; BG_TAIL=40 bash scripts/gpu/bg.sh wait run28 520; cp /root/part-*.tgz "$OUT"/; cp /root/bg/run28.log "$OUT"/
# Step E crashed in its first save point (the bench's save writer took no segment: claim_settle_s 0.05, every attempt
# slower than half of it; 10 pages not_admitted on a fresh card; fixed in eb8c9fd). Step C ran; R was running.
# Call 11 (carry .vllm-gpu/bin and .whl; the tree of eb8c9fd): wait for R, stop the job before F, then the restore path
# again from the new tree:
source .vllm-gpu/bin/device-install.sh >/dev/null || exit 1; export TMPDIR=/dev/shm
for i in $(seq 100); do [ -f /root/part-R.tgz ] && break; sleep 3; done
bash scripts/gpu/bg.sh stop run28; cp /root/part-R.tgz /root/bg/run28.log "$OUT"/
RESTORE_ARGS="--gb 16 --helpers 12 --queues 2 --target-workers 8 --target-reads splice,copy --save-processes 1,2,4" \
  timeout 300 bash scripts/gpu/validate.sh restore-path /root/res/E2                    # -> restore-path/
# Call 12: PYSPY_ARGS="--native" on the same restore path (8 GB) ended at once with rc 139 (py-spy 0.4.3 --native,
# SIGSEGV): nothing measured; the step was removed from run16.sh. Then the machine was given back.
# What the steps ran (run16.sh, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   C) BENCH_ARGS="--agents 16 --history-len 30000 --turns 5 --arms adp,cpu-offload --target-workers 8 \
#        --card-bytes 96G --offload-bytes 16G" $v agents                                  -> agents16-small-tier-30k/
#   R) RESTART_ARGS="--lengths 32000,100000 --target-workers 8 --arms baseline,adp-cold,adp-warm" $v restart
#                                                                                          -> restart/
