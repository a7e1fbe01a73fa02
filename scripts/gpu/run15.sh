#!/usr/bin/env bash
# The next H200 run (run 15), planned 2026-12-02 after run 14 (docs/benchmarks.md, "Run 14": its first machine was lost
# with every step after the scatter). The most important first; about 40 minutes on a warm machine, more than one
# session's 30: the last steps will not fit (each step archives itself as it ends; the next session starts there).
# The base wheel set is enough:
#   ../shared/gpu/prepare-wheels --chunk-mb 50   (8 chunks: with the checkout a 60 MB chunk is over 64 MiB),
#   plus .whl (validate.sh's header says which wheels)
# Start it in the background after the chunks, then collect /root/part-*.tgz with wait calls issued back to back (a
# gap over 30 s gives the machine back; bg.sh wait then fails at once with status 4 instead of waiting on nothing):
#   source .vllm-gpu/bin/device-install.sh && bash scripts/gpu/bg.sh start run15 bash scripts/gpu/run15.sh
#   bash scripts/gpu/bg.sh wait run15 540; cp /root/part-*.tgz "$OUT"/
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
R=/root/res
mkdir -p $R
export TMPDIR=/dev/shm
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep "Model name"; free -g;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > $R/host.txt 2>&1
v="bash $root/scripts/gpu/validate.sh"
# (a) the pipelines' tests on CUDA, and the scatter under a Python load at three interpreter switch intervals (run 14:
#     the fused copy moved 0.67 GB/s there at Python's default 5 ms: does a shorter interval free the restore driver?)
echo "== gpu-unit + scatter $(date +%T)"
$v gpu-unit $R/unit
SCATTER_GB=16 SCATTER_ARGS="--max-seconds 10 --switch-intervals 0.005,0.001,0.0002" $v scatter $R/scatter
(cd $R && tar czf /root/part-a.tgz host.txt unit scatter)
# (b) issue 14: agents 1, 4 and 8 at equal budgets, three arms, the card at MDTS 1M (run 14 ran 8 agents with two arms
#     only: adp 14.6 against cpu-offload 18.3 tok/s; the 1-agent cost gate and the no-connector arm are open)
echo "== agents $(date +%T)"
BENCH_ARGS="--agents 1,4,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 8 --card-bytes 64G \
--offload-bytes 64G" $v agents $R/agents
(cd $R && tar czf /root/part-b.tgz agents)
# (c) issue 14: 16 agents with a CPU tier below their working set (16 x 20k-token histories and 3 turns of 1.5k:
#     ~51 GB of KV) while the card holds it (not reached in runs 13 and 14)
echo "== agents-16-small-tier $(date +%T)"
BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp,cpu-offload --target-workers 8 --card-bytes 96G \
--offload-bytes 16G" $v agents $R/agents16
(cd $R && tar czf /root/part-c.tgz agents16)
# (d) issue 14: the sweep with the defaults, to 128 users
echo "== sweep $(date +%T)"
BENCH_ARGS="--users 1,16,64,128 --arms baseline,adp --target-workers 8" $v sweep $R/sweep
(cd $R && tar czf /root/part-d.tgz sweep)
# (e) issue 15: the restore path over 16 GB per point, splice against copy, 12 helpers of 2 queues, each also beside a
#     Python thread at 5 and 0.5 ms switch intervals (the engine's step loop beside the restore driver)
echo "== restore-path $(date +%T)"
RESTORE_ARGS="--gb 16 --helpers 12 --queues 2 --target-workers 8 --target-reads splice,copy --python-load 0.005,0.0005" \
  $v restore-path $R/rp
(cd $R && tar czf /root/part-e.tgz rp)
# (f) issue 14: the adp arm at 8 agents with the engine's interpreter switch interval at 0.5 ms (switch_interval_ms;
#     compare with (b)'s adp arm; run 14's scatter under a Python thread: 0.67 GB/s at the default 5 ms)
echo "== agents-8-switch-0.5ms $(date +%T)"
BENCH_ARGS="--agents 8 --turns 4 --arms adp --target-workers 8 --card-bytes 64G --connector-opt switch_interval_ms=0.5" \
  $v agents $R/agents8-switch05
(cd $R && tar czf /root/part-f.tgz agents8-switch05)
# (g) issue 14/15: the adp arm at 8 agents with py-spy on the engine's process tree (where the restore driver and the
#     helpers spend a restore in the real engine: run 14 restored at 6.5-10 GB/s there against 12.4 in the bench)
echo "== agents-8-profiled $(date +%T)"
BENCH_ARGS="--agents 8 --turns 4 --arms adp --target-workers 8 --card-bytes 64G --profile adp" $v agents $R/agents8-prof
(cd $R && tar czf /root/part-g.tgz agents8-prof)
# (h) the MDTS A/B: the adp arm at 8 agents with the old 128K card, on the same machine
echo "== agents-mdts-128k $(date +%T)"
BENCH_ARGS="--agents 8 --turns 4 --arms adp --target-workers 8 --card-bytes 64G --target-mdts 128K" \
  $v agents $R/agents-mdts128k
(cd $R && tar czf /root/part-h.tgz agents-mdts128k)
echo "== done $(date +%T)"
