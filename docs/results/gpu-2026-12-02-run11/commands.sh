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

# ---- run 11 as it went on, after the chain above ended (same machine, further calls back to back) ----
# (f) GDN on FlashInfer, second try: the wheels install into /tmp/site through PYTHONPATH, where Python does not
#     read .pth files, so nvidia-cutlass-dsl's nvidia_cutlass_dsl_packages.pth never put its dsl_packages on the path
#     (flashinfer.gdn_kernels' SM90 import failed quietly and gdn_prefill raised "SM90 GDN prefill DSL kernel is
#     unavailable"). Put the path there by hand:
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH TMPDIR=/dev/shm
GDN_ARGS="" FAMILY_JOBS=2 FAMILY_TIMEOUT=480 FAMILIES="gdn gdn+corrupt-states" \
  bash scripts/gpu/validate.sh families /root/res/fi2        # -> gdn-flashinfer/2-no-quack
# (g) vLLM's CuTe DSL linear kernels then want quack-kernels; the newest wheel (0.6.5, carried in .whl2) does not
#     match nvidia-cutlass-dsl 4.6.0 (No module named 'cutlass.base_dsl.enums'):
pip install --no-deps --no-index --target /tmp/site .whl2/quack_kernels-0.6.5-py3-none-any.whl
GDN_ARGS="" FAMILY_JOBS=2 FAMILY_TIMEOUT=440 FAMILIES="gdn gdn+corrupt-states" \
  bash scripts/gpu/validate.sh families /root/res/fi3        # -> gdn-flashinfer/3-quack-0.6.5
# (h) issue 15/14: helpers x queues on the restore path, 2 queues per helper
RESTORE_ARGS="--gb 4 --helpers 4,8,12 --queues 2 --target-workers 8,12" \
  bash scripts/gpu/validate.sh restore-path /root/res/rpq2  # -> restore-path/restore-path-helpers-q2.json
# (i) issue 14: the 8-agent point with 12 helpers of 2 queues and 8 target workers (adp arm only; against (c)'s arms)
BENCH_ARGS="--agents 8 --turns 4 --arms adp --target-workers 8 --card-bytes 64G --connector-opt load_processes=12 \
--connector-opt io_queues=2" bash scripts/gpu/validate.sh agents /root/res/agents-lp12   # -> agents-lp12
