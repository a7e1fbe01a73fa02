#!/usr/bin/env bash
# GPU run 14 as it ran (2026-12-02, one H200): docs/benchmarks.md "Run 14".
# Call 1 (after the 8 chunks): scripts/gpu/run14.sh in the background; its step (a) finished (host.txt, unit/,
# scatter/), then the machine was lost between two wait calls (a transient gap on the caller's side over the
# 30 s idle limit) with step (b) running: (b) onwards are gone. A second, bare machine (the chunks again), one call:
source .vllm-gpu/bin/device-install.sh && export TMPDIR=/dev/shm
BENCH_ARGS="--agents 8 --turns 4 --arms adp,cpu-offload --target-workers 8 --card-bytes 64G --offload-bytes 64G" \
  timeout 420 bash scripts/gpu/validate.sh agents "$OUT/a8"     # -> agents8/

# ---- call 1 ran scripts/gpu/run14.sh, as it was then (its step order: a, b, d, e, f, c; renamed run15.sh since):
# #!/usr/bin/env bash
# # The next H200 run (run 14), planned 2026-12-02 after run 13 (docs/benchmarks.md, "Since run 13"), the most important
# # first. About 28 minutes on a warm machine (the restore path, the sweep and the 128K A/B come last: cut them if time is short);
# # the base wheel set is enough:
# #   ../shared/gpu/prepare-wheels --chunk-mb 50   (8 chunks: with the 14 MB checkout a 60 MB chunk is over 64 MiB),
# #   plus .whl (validate.sh's header says which wheels)
# # Start it in the background after the chunks, and collect /root/part-*.tgz as each appears:
# #   source .vllm-gpu/bin/device-install.sh && bash scripts/gpu/bg.sh start run14 bash scripts/gpu/run14.sh
# #   bash scripts/gpu/bg.sh wait run14 540; cp /root/part-*.tgz "$OUT"/
# set -u
# root=$(cd "$(dirname "$0")/../.." && pwd)
# R=/root/res
# mkdir -p $R
# export TMPDIR=/dev/shm
# { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep "Model name"; free -g;
#   python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
#   > $R/host.txt 2>&1
# v="bash $root/scripts/gpu/validate.sh"
# # (a) the pipelines' tests on CUDA, and the scatter alone: per-layer against fused (programs now sized to the longest
# #     run), idle, under a GPU load and under a Python load; each point stops after 20 s (run 13's per-layer point
# #     under the Python load had not moved 16 GB in 200 s)
# echo "== gpu-unit + scatter $(date +%T)"
# $v gpu-unit $R/unit
# SCATTER_GB=16 $v scatter $R/scatter
# (cd $R && tar czf /root/part-a.tgz host.txt unit scatter)
# # (b) issue 14: agents 1 and 8 at equal budgets, three arms, with the bench's emulated card now at MDTS 1M (every
# #     agents run through run 13 had the emulator's 128K: 16 commands per 2 MiB page)
# echo "== agents $(date +%T)"
# BENCH_ARGS="--agents 1,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 8 --card-bytes 64G \
# --offload-bytes 64G" $v agents $R/agents
# (cd $R && tar czf /root/part-b.tgz agents)
# # (d) issue 14: 16 agents with a CPU tier below their working set (16 x 20k-token histories and 3 turns of 1.5k:
# #     ~51 GB of KV) while the card holds it (not reached in run 13)
# echo "== agents-16-small-tier $(date +%T)"
# BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp,cpu-offload --target-workers 8 --card-bytes 96G \
# --offload-bytes 16G" $v agents $R/agents16
# (cd $R && tar czf /root/part-d.tgz agents16)
# # (e) issue 14: the sweep with the defaults, to 128 users
# echo "== sweep $(date +%T)"
# BENCH_ARGS="--users 1,16,64,128 --arms baseline,adp --target-workers 8" $v sweep $R/sweep
# (cd $R && tar czf /root/part-e.tgz sweep)
# # (f) issue 15: the restore path over 16 GB per point, splice against copy, 12 helpers of 2 queues
# echo "== restore-path $(date +%T)"
# RESTORE_ARGS="--gb 16 --helpers 12 --queues 2 --target-workers 8 --target-reads splice,copy" $v restore-path $R/rp
# (cd $R && tar czf /root/part-f.tgz rp)
# # (c) the MDTS A/B: the adp arm at 8 agents with the old 128K card, on the same machine
# echo "== agents-mdts-128k $(date +%T)"
# BENCH_ARGS="--agents 8 --turns 4 --arms adp --target-workers 8 --card-bytes 64G --target-mdts 128K" \
#   $v agents $R/agents-mdts128k
# (cd $R && tar czf /root/part-c.tgz agents-mdts128k)
# echo "== done $(date +%T)"
