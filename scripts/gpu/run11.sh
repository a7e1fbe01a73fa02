#!/usr/bin/env bash
# The next H200 run (run 11), planned 2026-12-02 after run 10: what run 10 left unmeasured (docs/benchmarks.md,
# "Since run 10"). About 25 minutes on a warm machine, the most important first.
# The wheel set needs the GDN FlashInfer wheels for part (d) (docs/connector.md, "Mamba2 and GDN on the H200"):
#   cat ../shared/gpu/requirements-vllm-0.26.0.txt scripts/gpu/requirements-gdn-flashinfer-vllm-0.26.0.txt > /tmp/req.txt
#   ../shared/gpu/prepare-wheels --chunk-mb 52 --req /tmp/req.txt
# Start it in the background after the chunks are installed, and collect /root/part-*.tgz as each appears:
#   source .vllm-gpu/bin/device-install.sh && bash scripts/gpu/bg.sh start run11 bash scripts/gpu/run11.sh
#   bash scripts/gpu/bg.sh wait run11 540; cp /root/part-*.tgz "$OUT"/
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
R=/root/res
mkdir -p $R
export TMPDIR=/dev/shm
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep "Model name"; free -g; } \
  > $R/host.txt 2>&1
v="bash $root/scripts/gpu/validate.sh"
# (a) issue 15: the restore path with the target's reads spliced from the card's pages (the emulator's new default)
# against the copying path, same run, same ceiling
echo "== restore-path $(date +%T)"
RESTORE_ARGS="--gb 4 --helpers 4,8 --target-workers 8 --target-reads splice,copy" $v restore-path $R/rp
(cd $R && tar czf /root/part-a.tgz host.txt rp)
# (b) issue 15: the restart with the connector's host defaults (runs 9 and 10 pinned one helper), to 200k tokens
echo "== restart $(date +%T)"
RESTART_ARGS="--lengths 32000,100000,200000 --target-workers 8 --arms baseline,adp-cold,adp-warm --profile adp-warm" \
  $v restart $R/restart
(cd $R && tar czf /root/part-b.tgz restart)
# (c) issue 14: agents with the policy that no longer charges restores in flight, three arms
echo "== agents $(date +%T)"
BENCH_ARGS="--agents 1,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 4 --card-bytes 64G \
--offload-bytes 64G --profile adp" $v agents $R/agents
(cd $R && tar czf /root/part-c.tgz agents)
# (d) issue 14: the same 8-agent point with every hit restored (restore_policy always), against (c)'s arms
echo "== agents-always $(date +%T)"
BENCH_ARGS="--agents 8 --turns 4 --arms adp --target-workers 4 --card-bytes 64G --connector-opt restore_policy=always" \
  $v agents $R/agents-always
(cd $R && tar czf /root/part-d.tgz agents-always)
# (e) issue 16: GDN on vLLM's default SM90 prefill (FlashInfer, JIT-compiled at first use) with its control
echo "== gdn-flashinfer $(date +%T)"
GDN_ARGS="" FAMILY_JOBS=2 FAMILY_TIMEOUT=540 FAMILIES="gdn gdn+corrupt-states" $v families $R/families-flashinfer
(cd $R && tar czf /root/part-e.tgz families-flashinfer)
echo "== done $(date +%T)"
