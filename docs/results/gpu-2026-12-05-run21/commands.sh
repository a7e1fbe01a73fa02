#!/usr/bin/env bash
# GPU run 21 as it ran (2026-12-05, one H200, main at b8c54b6's parent 5d6569b: declined saves are not failures
# (88df851), the sweep's settle between points (5d6569b)): docs/benchmarks.md "Run 21". vLLM 0.26.0 from the base
# wheel set (../shared/gpu/prepare-wheels --chunk-mb 46: 9 chunks).
# Calls 1-8, one chunk each (carry .vllm-gpu/chunks/partNN), ~3.5 s apart (the first waited ~80 s for the machine):
mkdir -p /root/stash && cp .vllm-gpu/chunks/part* /root/stash/ && ls /root/stash | wc -l
# Call 9 (carry part08, .vllm-gpu/bin and .whl): install (8 s); two copies of the tree, the second with 88df851 undone
# (declined pages reported as failed saves again), then the steps in the background:
source .vllm-gpu/bin/device-install.sh || exit 1; rm -rf /root/tree /root/tree-old && cp -a . /root/tree &&
  cp -a . /root/tree-old && sed -i 's/for r in bad)$/for r in bad + declined)/' \
  /root/tree-old/connector/src/adp_connector/pipeline/save.py &&
  grep -c "bad + declined" /root/tree-old/connector/src/adp_connector/pipeline/save.py && cd /root/tree &&
  bash scripts/gpu/bg.sh start run21 bash -c 'cd /root/tree && STEPS=v bash scripts/gpu/run16.sh;
    cd /root/tree-old && RUN16_TAG=old STEPS=v bash scripts/gpu/run16.sh;
    cd /root/tree && STEPS=d SWEEP_USERS=1,16,64,128,192 bash scripts/gpu/run16.sh'
# Calls 10-13 waited for each archive and copied it back (part-v.tgz, part-old-v.tgz); the sweep's part-d.tgz never
# came: its adp arm's 192-user point stalled the host (512 GiB card in /dev/shm, 125 GiB RAM). Call 14 took what
# the sweep had written (its engine logs) and the bench's log:
cp /root/part-d.tgz "$OUT"/ 2>/dev/null; tar czf "$OUT"/partial-d.tgz -C /root/res host.txt d; cp /root/bg/run21.log "$OUT"/
# What each step ran (run16.sh's case at 5d6569b, v="bash scripts/gpu/validate.sh", TMPDIR=/dev/shm):
#   v) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp --target-workers 8 --card-bytes 32G" $v agents
#        -> agents16-card32g-declined-not-failed/ (tree), old-tree/agents16-card32g-declined-as-failed/ (tree-old)
#   d) BENCH_ARGS="--users 1,16,64,128,192 --arms baseline,adp --target-workers 8" $v sweep
#        -> sweep-to-192-unfinished/ (run21.log: the bench's progress lines; points-from-log.json: each point's last
#           line, extracted here, in sweep-to-192-unfinished/, with the Python below)
# python3 - <<'EOF'
# import json, re
# pts = {}
# for line in open("run21.log"):
#     m = re.match(r"(baseline|adp) (\d+) user\(s\): (\d+)/(\d+) \(([\d.]+) s\)", line)
#     if m:
#         arm, u, done, tot, t = m.groups()
#         pts.setdefault(arm, {})[u] = {"done": int(done), "requests": int(tot), "wall_s": float(t)}
# ...  # written as "points", with the GPU, host cores and RAM from host.txt, and adp_over_baseline_wall per point
# EOF
# 1,763 of 1,800 s of device time.
