#!/usr/bin/env bash
# GPU run 27 as it ran (2026-12-06, the tree of 7176d60: main at 759212d plus the lookup mirror, committed as 7176d60
# after the run started). Asked with no kind; lent an H100 80GB HBM3 (16 cores, 125 GiB RAM, /dev/shm 128 GiB) after
# several refused starts: every ratio is between arms of this run on this machine. vLLM 0.26.0 from the base wheel set
# (../shared/gpu/prepare-wheels --chunk-mb 42: 9 chunks).
# Calls 1-8, one chunk each (carry .vllm-gpu/chunks/partNN):
mkdir -p /root/stash && cp .vllm-gpu/chunks/part* /root/stash/ && ls /root/stash | wc -l
# Call 9 (carry part08, .vllm-gpu/bin and .whl): install, the steps in the background from a copy of the tree, a wait:
source .vllm-gpu/bin/device-install.sh || exit 1; rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  bash scripts/gpu/bg.sh start run27 bash -c 'cd /root/tree && STEPS="b j" bash scripts/gpu/run16.sh'
sleep 1; BG_TAIL=30 bash scripts/gpu/bg.sh wait run27 500; cp /root/part-*.tgz "$OUT"/
tar czf "$OUT"/partial.tgz -C /root/res .; cp /root/bg/run27.log "$OUT"/
# Step b ended within that call; step j had started when it returned. No next call came within 30 s (this session's
# connection to the tool broke), so the machine went back and j's results are lost.
# What step b ran (run16.sh at this tree, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   b) BENCH_ARGS="--agents 1,4,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 8 --card-bytes 64G \
#        --offload-bytes 64G" $v agents                                              -> agents-1-4-8/
