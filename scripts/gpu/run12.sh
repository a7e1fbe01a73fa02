#!/usr/bin/env bash
# The next H200 run (run 12), planned 2026-12-02 after run 11: what run 11 left unmeasured (docs/benchmarks.md,
# "Since run 11"), the most important first. About 24 minutes on a warm machine; the base wheel set is enough
# (GDN on FlashInfer waits for the matching quack-kernels wheel):
#   ../shared/gpu/prepare-wheels            (7 chunks), plus .whl (validate.sh's header says which wheels)
# Start it in the background after the chunks, and collect /root/part-*.tgz as each appears:
#   source .vllm-gpu/bin/device-install.sh && bash scripts/gpu/bg.sh start run12 bash scripts/gpu/run12.sh
#   bash scripts/gpu/bg.sh wait run12 540; cp /root/part-*.tgz "$OUT"/
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
R=/root/res
mkdir -p $R
export TMPDIR=/dev/shm
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep "Model name"; free -g; } \
  > $R/host.txt 2>&1
v="bash $root/scripts/gpu/validate.sh"
# (a) the pipelines' tests on CUDA (PagedKV.scatter reads the pages in place; the restore stream's priority), and the
#     scatter alone at both stream priorities, idle and under a compute load
echo "== gpu-unit + scatter $(date +%T)"
$v gpu-unit $R/unit
mkdir -p $R/scatter && timeout 180 python3 $root/scripts/gpu/scatter_bench.py --gb 16 --out $R/scatter/scatter.json \
  > $R/scatter/scatter.txt 2>&1; tail -4 $R/scatter/scatter.txt
(cd $R && tar czf /root/part-a.tgz host.txt unit scatter)
# (c) issue 14: agents 1 and 8 at equal budgets with the new defaults (12 helpers of 2 queues, the high-priority
#     restore stream), three arms, no profiler
echo "== agents $(date +%T)"
BENCH_ARGS="--agents 1,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 8 --card-bytes 64G \
--offload-bytes 64G" $v agents $R/agents
(cd $R && tar czf /root/part-c.tgz agents)
# (d) issue 14: 16 agents with a CPU tier below their working set (16 x 20k-token histories and 3 turns of 1.5k:
#     ~51 GB of KV) while the card holds it
echo "== agents-16-small-tier $(date +%T)"
BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp,cpu-offload --target-workers 8 --card-bytes 96G \
--offload-bytes 16G" $v agents $R/agents16
(cd $R && tar czf /root/part-d.tgz agents16)
# (b) issue 15: the restart with the new host defaults (12 helpers of 2 queues), to 200k tokens
echo "== restart $(date +%T)"
RESTART_ARGS="--lengths 32000,100000,200000 --target-workers 8 --arms baseline,adp-cold,adp-warm" $v restart $R/restart
(cd $R && tar czf /root/part-b.tgz restart)
# (e) issue 15: the restore path over 16 GB per point (run 11's 4 GB points were too short to rank splice and copy)
echo "== restore-path $(date +%T)"
RESTORE_ARGS="--gb 16 --helpers 12 --queues 2 --target-workers 8 --target-reads splice,copy" $v restore-path $R/rp
(cd $R && tar czf /root/part-e.tgz rp)
echo "== done $(date +%T)"
