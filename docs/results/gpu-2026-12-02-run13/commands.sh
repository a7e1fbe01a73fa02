#!/usr/bin/env bash
# The next H200 run (run 13), planned 2026-12-02: the one-launch page copy (page_copy=fused, the new default) checked
# and measured, and what run 12 measured but never archived, the most important first. About 24 minutes on a warm
# machine; the base wheel set is enough:
#   ../shared/gpu/prepare-wheels            (7 chunks), plus .whl (validate.sh's header says which wheels)
# Start it in the background after the chunks, and collect /root/part-*.tgz as each appears:
#   source .vllm-gpu/bin/device-install.sh && bash scripts/gpu/bg.sh start run13 bash scripts/gpu/run13.sh
#   bash scripts/gpu/bg.sh wait run13 540; cp /root/part-*.tgz "$OUT"/
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
R=/root/res
mkdir -p $R
export TMPDIR=/dev/shm
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep "Model name"; free -g;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > $R/host.txt 2>&1
v="bash $root/scripts/gpu/validate.sh"
# (a) the pipelines' tests on CUDA (the Triton page copy against the per-layer path), and the scatter alone: per-layer
#     against fused, with the GPU idle, under a GPU load and under a Python load
echo "== gpu-unit + scatter $(date +%T)"
$v gpu-unit $R/unit
SCATTER_GB=16 $v scatter $R/scatter
(cd $R && tar czf /root/part-a.tgz host.txt unit scatter)
# (b) correctness of the fused copy with vLLM's own layouts: dense (FlashAttention K/V) and MLA, cold -> restart ->
#     warm, every restored page compared, outputs against the local-hit reference
echo "== families $(date +%T)"
FAMILY_JOBS=2 FAMILY_TIMEOUT=300 FAMILIES="dense mla" $v families $R/families
(cd $R && tar czf /root/part-b.tgz families)
# (c) issue 14: agents 1 and 8 at equal budgets with the defaults (fused copy, 12 helpers of 2 queues, high-priority
#     restore stream), three arms
echo "== agents $(date +%T)"
BENCH_ARGS="--agents 1,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 8 --card-bytes 64G \
--offload-bytes 64G" $v agents $R/agents
(cd $R && tar czf /root/part-c.tgz agents)
# (d) the A/B of the copy: the adp arm at 8 agents with page_copy=per_layer, on the same machine
echo "== agents-per-layer $(date +%T)"
BENCH_ARGS="--agents 8 --turns 4 --arms adp --target-workers 8 --card-bytes 64G --connector-opt page_copy=per_layer" \
  $v agents $R/agents-per-layer
(cd $R && tar czf /root/part-d.tgz agents-per-layer)
# (e) issue 15: the restart with the host defaults, to 200k tokens
echo "== restart $(date +%T)"
RESTART_ARGS="--lengths 32000,100000,200000 --target-workers 8 --arms baseline,adp-cold,adp-warm" $v restart $R/restart
(cd $R && tar czf /root/part-e.tgz restart)
# (f) issue 14: 16 agents with a CPU tier below their working set (16 x 20k-token histories and 3 turns of 1.5k:
#     ~51 GB of KV) while the card holds it
echo "== agents-16-small-tier $(date +%T)"
BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp,cpu-offload --target-workers 8 --card-bytes 96G \
--offload-bytes 16G" $v agents $R/agents16
(cd $R && tar czf /root/part-f.tgz agents16)
echo "== done $(date +%T)"
