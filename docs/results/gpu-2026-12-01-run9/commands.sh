#!/usr/bin/env bash
# GPU run 9 as run (2026-12-01): the chain started with `bash scripts/gpu/bg.sh start run9 bash commands.sh` after the wheel chunks
set -u
R=/root/res
mkdir -p $R
export TMPDIR=/dev/shm
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep "Model name"; free -g; } > $R/host.txt 2>&1
echo "== unit+families $(date +%T)"
bash scripts/gpu/validate.sh gpu-unit $R/unit > $R/unit.log 2>&1 &
FAMILY_JOBS=7 FAMILY_TIMEOUT=420 FAMILIES="mtp gdn mamba dsa mla swa swa:mistral dense gdn+corrupt-states mamba+corrupt-states dsa+corrupt mla+corrupt swa+corrupt dense+corrupt" \
  bash scripts/gpu/validate.sh families $R/families
wait
cat $R/unit/gpu-unit.txt
(cd $R && tar czf /root/part-a.tgz host.txt unit unit.log families)
echo "== restore-path $(date +%T)"
RESTORE_ARGS="--gb 4 --helpers 4,8 --target-workers 8" bash scripts/gpu/validate.sh restore-path $R/rp
(cd $R && tar czf /root/part-b.tgz rp)
echo "== agents $(date +%T)"
BENCH_ARGS="--agents 1,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 4 --card-bytes 64G --offload-bytes 64G --profile adp,baseline,cpu-offload" \
  bash scripts/gpu/validate.sh agents $R/agents
(cd $R && tar czf /root/part-c.tgz agents)
echo "== sweep $(date +%T)"
BENCH_ARGS="--arms baseline,adp --users 1,16,128 --requests-per-user 2 --target-workers 4 --card-bytes 80G --profile baseline,adp" \
  bash scripts/gpu/validate.sh sweep $R/sweep
(cd $R && tar czf /root/part-d.tgz sweep)
echo "== done $(date +%T)"
