#!/usr/bin/env bash
# GPU run 16 as it ran (2026-12-03, one H200, main at 39d6631): docs/benchmarks.md "Run 16". After the 8 chunks of the
# base wheel set, one call started scripts/gpu/run16.sh (at 39d6631) in the background with these steps, then wait
# calls collected /root/part-*.tgz (x -> agents8/, c -> agents16-small-tier/, f -> agents8-switch05-lockprofile/,
# k -> agents8-ceiling/, s -> scatter/):
source .vllm-gpu/bin/device-install.sh && STEPS="x c f k s" bash scripts/gpu/bg.sh start run16 bash scripts/gpu/run16.sh
bash scripts/gpu/bg.sh wait run16 540; cp /root/part-*.tgz "$OUT"/    # twice
# then, on the same machine, one call each:
STEPS="e" bash scripts/gpu/bg.sh start run16e bash scripts/gpu/run16.sh; bash scripts/gpu/bg.sh wait run16e 420  # -> restore-path/
export TMPDIR=/dev/shm
BENCH_ARGS="--agents 8 --turns 4 --target-workers 8 --card-bytes 64G --arms adp --connector-opt switch_interval_ms=0.2" \
  timeout 420 bash scripts/gpu/validate.sh agents /root/res/f2                                           # -> agents8-switch02/
STEPS="u" timeout 300 bash scripts/gpu/run16.sh                                                          # -> unit/
# What each step ran (run16.sh's case, v="bash scripts/gpu/validate.sh", A8="--agents 8 --turns 4 --target-workers 8
# --card-bytes 64G"):
#   x) BENCH_ARGS="$A8 --arms adp,cpu-offload --offload-bytes 64G" $v agents
#   c) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp,cpu-offload --target-workers 8 --card-bytes 96G
#        --offload-bytes 16G" $v agents
#   f) BENCH_ARGS="$A8 --arms adp --connector-opt switch_interval_ms=0.5 --profile adp --profile-gil" $v agents
#   k) BENCH_ARGS="--agents 8 --turns 4 --arms baseline --kv-cache-bytes 80G" $v agents
#   s) SCATTER_GB=16 SCATTER_ARGS="--max-seconds 10 --switch-intervals 0.005,0.001,0.0002" $v scatter
#   e) RESTORE_ARGS="--gb 16 --helpers 12 --queues 2 --target-workers 8 --target-reads splice,copy
#        --python-load 0.005,0.0005" $v restore-path
#   u) $v gpu-unit
# Later, a second machine (main at a094ec4: saves that wait for staging), the pipelines' tests alone on CUDA, no vLLM
# wheels needed (-> pipeline-cuda-waiting-saves.txt: 51 passed, 1 skipped):
python3 -m pip install -q --no-index --no-deps --target /tmp/site-adp .whl/*.whl
PYTHONPATH=/tmp/site-adp:wire/src:connector/src:emulator/src:testbed/src PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 \
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs connector/tests/pipeline
