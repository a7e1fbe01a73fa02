#!/usr/bin/env bash
# The next H200 run (run 10), planned 2026-12-01 after run 9: what run 9 left unmeasured (docs/benchmarks.md, "Since
# run 9"). About 24 minutes on a warm machine, in the order that matters most if the device time runs out.
# Start it in the background after the wheel chunks are installed, and collect /root/part-*.tgz as each appears:
#   source .vllm-gpu/bin/device-install.sh && bash scripts/gpu/bg.sh start run10 bash scripts/gpu/run10.sh
#   bash scripts/gpu/bg.sh wait run10 540; cp /root/part-*.tgz "$OUT"/
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
R=/root/res
mkdir -p $R
export TMPDIR=/dev/shm
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep "Model name"; free -g; } \
  > $R/host.txt 2>&1
v="bash $root/scripts/gpu/validate.sh"
# (a) issue 16: the two hybrids fixed after run 9, with their negative controls; the pipelines' GPU tests (the
#     restore driver thread on CUDA) beside them
echo "== unit+families $(date +%T)"
$v gpu-unit $R/unit > $R/unit.log 2>&1 &
FAMILY_JOBS=4 FAMILY_TIMEOUT=420 FAMILIES="mamba gdn mamba+corrupt-states gdn+corrupt-states" $v families $R/families
wait
(cd $R && tar czf /root/part-a.tgz host.txt unit unit.log families)
# (b) issue 15: the receive path with MSG_WAITALL, same points as run 9
echo "== restore-path $(date +%T)"
RESTORE_ARGS="--gb 4 --helpers 4,8 --target-workers 8" $v restore-path $R/rp
(cd $R && tar czf /root/part-b.tgz rp)
# (c) issue 14: agents with the engine-wide restore policy, the restore driver thread, the save turn, save rates
echo "== agents $(date +%T)"
BENCH_ARGS="--agents 1,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 4 --card-bytes 64G \
--offload-bytes 64G --profile adp,baseline" $v agents $R/agents
(cd $R && tar czf /root/part-c.tgz agents)
# (d) issue 14: the sweep (the policy's first four restores decide the 1-user point)
echo "== sweep $(date +%T)"
BENCH_ARGS="--arms baseline,adp --users 1,16,128 --requests-per-user 2 --target-workers 4 --card-bytes 80G \
--profile adp" $v sweep $R/sweep
(cd $R && tar czf /root/part-d.tgz sweep)
# (e) issue 15: the restart regression of run 9 (3.5 GB/s end to end), profiled this time
echo "== restart $(date +%T)"
RESTART_ARGS="--lengths 32000,100000 --target-workers 8 --arms baseline,adp-cold,adp-warm --profile adp-warm" \
  $v restart $R/restart
(cd $R && tar czf /root/part-e.tgz restart)
echo "== done $(date +%T)"
