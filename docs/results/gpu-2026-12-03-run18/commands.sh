#!/usr/bin/env bash
# GPU run 18 as it ran (2026-12-03, one H200, two machines): docs/benchmarks.md "Run 18".
# Machine 1 (main at 33d2e2d, then the GDN checkpoint change of 618f32c): the 10 chunks of the GDN wheel set
# (.vllm-gpu-gdn/, one call each; a superset of the base set), then from a copy of the tree:
source .vllm-gpu-gdn/bin/device-install.sh && rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
  STEPS="o n" bash scripts/gpu/bg.sh start run18 bash scripts/gpu/run16.sh       # o -> agents1-cost/
bash scripts/gpu/bg.sh wait run18 290; cp /root/part-*.tgz "$OUT"/               # back to back
# n failed at once ("DSL kernel only supports D=128, got 64"): v and w ran while the checkpoint was changed
STEPS="v" bash scripts/gpu/bg.sh start run18v bash scripts/gpu/run16.sh           # -> agents16-card32g-slru/
STEPS="w" bash scripts/gpu/bg.sh start run18w bash scripts/gpu/run16.sh           # -> agents16-card32g-lru/
# n again from a fresh copy (head dim 128 and 4 value heads: "block_size (272) must be <= max_num_batched_tokens
# (256)"), then with 1 key / 2 value heads -> families-gdn-flashinfer/ (engine-gdn-backend.txt: its engine log's
# backend lines)
STEPS="n" bash scripts/gpu/bg.sh start run18n2 bash scripts/gpu/run16.sh
# Machine 2 (main at 1a9b07b: the local hit neither looked up nor walked for saves): the 10 chunks again, then
STEPS="o" bash scripts/gpu/bg.sh start run18o bash scripts/gpu/run16.sh          # -> agents1-cost-localhit/
# What each step ran (run16.sh's case, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   o) BENCH_ARGS="--agents 1 --turns 4 --arms baseline,adp --target-workers 8 --card-bytes 64G" $v agents
#   v) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp --target-workers 8 --card-bytes 32G" $v agents
#   w) the same with --connector-opt eviction=lru
#   n) GDN_ARGS="" FAMILY_JOBS=2 FAMILY_TIMEOUT=540 FAMILIES="gdn gdn+corrupt-states" $v families
# host.txt: its pip list ran with the wheel set on PYTHONPATH, so it mixes /tmp/site's packages in (cutlass-dsl,
# cuda-python, ...); run16.sh now lists the image's own (env -u PYTHONPATH).
