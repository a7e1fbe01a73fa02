#!/usr/bin/env bash
# GPU run 29 as it ran (2026-12-07, evening; the tree of df91c8e plus run16.sh's step M, committed with these results).
# First asked for nvidia-h200: lent an H100, which was taken back for other work 155 s into its run (nothing came
# back); two refused starts followed. Then lent one NVIDIA H200 (143,771 MiB, driver 580.159.04), 16 cores, 125 GiB
# RAM, kernel 6.18.44-fc-v1294-gpu (Firecracker): host.txt. vLLM 0.26.0 from the base wheel set:
# ../shared/gpu/prepare-wheels --chunk-mb 40 (10 chunks). ~1,500 s of the session's 1,800 s of device time in all.
# Calls 1-9, one chunk each (carry .vllm-gpu/chunks/partNN):
mkdir -p /root/stash && cp .vllm-gpu/chunks/part* /root/stash/ && ls /root/stash | wc -l
# Call 10 (carry part09, .vllm-gpu/bin and .whl): install, the steps in the background from a copy of the tree:
source .vllm-gpu/bin/device-install.sh; rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  bash scripts/gpu/bg.sh start run29 bash -c 'cd /root/tree && STEPS="L M H" bash scripts/gpu/run16.sh'
# Calls 11 and 12, back to back:
cd /root/tree && BG_TAIL=30 bash scripts/gpu/bg.sh wait run29 500; cp /root/part-*.tgz "$OUT"/
cd /root/tree && BG_TAIL=40 bash scripts/gpu/bg.sh wait run29 460; cp /root/part-H.tgz "$OUT"/
tar czf $OUT/partial-H.tgz -C /root res/H bg/run29.log                                   # run29.log
# What the steps ran (run16.sh, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   L) RESTORE_ARGS="--gb 16 --helpers 8,12,16 --queues 2 --target-workers 8 --target-reads splice" \
#        $v restore-path                                                                  -> restore-path-landing/
#   M) RESTORE_ARGS="--gb 16 --helpers 12 --queues 2 --target-workers 8 --target-reads splice --batch-mb 2 \
#        --slabs 16" $v restore-path                                                      -> restore-path-small-staging/
#   H) BENCH_ARGS="--agents 8 --history-len 64000 --turns 4 --max-model-len 80000 \
#        --arms baseline,cpu-offload,adp --target-workers 8 --card-bytes 64G --offload-bytes 64G" $v agents
#                                                                                         -> agents8-64k/
# L's py-spy profile is kept (restore-path-landing/restore-path.pyspy.txt.gz, raw, 50 Hz); the receive threads' split in
# docs/benchmarks.md (run 29) counts the leaf frame of every sample whose stack holds QueuePair._read_loop. M's is not
# kept.
