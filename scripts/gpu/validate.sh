#!/usr/bin/env bash
# GPU validation (issue #7) on the lent H200, after the vLLM 0.26 wheels are installed (the machine has no network:
# the pinned wheels are carried in as chunks and installed with pip --no-index into /tmp/site; that recipe is not
# part of this repository; device-install.sh exports PYTHONPATH/PATH and VLLM_USE_FLASHINFER_SAMPLER=0):
#   source .vllm-gpu/bin/device-install.sh && bash scripts/gpu/validate.sh correctness|restart OUTDIR
# gpu-unit:    the connector's GPU data-path unit tests (side-stream copies, pinned shared staging).
# scatter:     scripts/gpu/scatter_bench.py (the restore's scatter at both stream priorities, idle and busy GPU).
# correctness: gpu-unit, connector import smoke, `testbed verify --family dense` (cold -> restart -> warm, random weights,
#              every restored page compared), the NVMe/TCP data path (1..16 queues, 1 MiB reads, stream ceiling).
# datapath:    client reads into GPU memory through pinned buffers, 1..16 queues, target I/O workers 0/4/8.
# restore-path: `testbed bench restore-path` (helper processes x target workers, into GPU memory) under py-spy
#              (PYSPY_ARGS replaces --nonblocking, e.g. "--native" for the C frames: checksums, the interpreter,
#              libc; py-spy pauses each process per sample to unwind them).
# families:    `testbed verify` for swa (Gemma3), swa:mistral (all layers SWA), mla (DeepSeek-V3 MLA), dsa
#              (DeepSeek-V3.2: MLA + indexer pages), mtp (+ MTP head: acceptance off / on); FAMILIES="..." picks
#              others, VERIFY_ARGS adds verify options (e.g. "--block-size 16"; GDN without flashinfer:
#              "--engine-kwarg gdn_prefill_backend=triton"; the state negative control: "--corrupt-state-pages").
# restart:     scripts/gpu/restart_ttft.py (8B shape, 8k..200k tokens; baseline / cold / warm after restart).
# agents|sweep: `testbed bench agents|sweep --preset gpu` on the 8B shape (dummy weights, `vllm serve`), arms
#              baseline, cpu-offload (vLLM's OffloadingConnector) and adp; BENCH_ARGS adds options, e.g.
#              "--agents 1,4,8 --turns 3 --target-workers 4 --connector-opt load_processes=4 --connector-opt
#              io_queues=4" (size them to the device time left; the card is file-backed in /tmp); the adp arm's
#              same-run ratios against the others are printed last and stored as `ratios` in results.json.
set -u
what=${1:?correctness or restart}
out=${2:?output directory}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/../.." && pwd)
# .whl (git-ignored, sent with `carry`): the connector's own wheels for the GPU image's Python 3.12, fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl crc32c xxhash py-spy \
#       pytest==8.3.4 pluggy==1.5.0 iniconfig==2.0.0
if ls "$root"/.whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site-adp/.done ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site-adp "$root"/.whl/*.whl && touch /tmp/site-adp/.done
fi
# the connector rides on PYTHONPATH (not pip-installed): give it the dist-info its vLLM plugin entry point lives in
di=/tmp/site-adp/adp_kv_connector-0.1.0.dist-info
mkdir -p "$di"
printf 'Metadata-Version: 2.1\nName: adp-kv-connector\nVersion: 0.1.0\n' > "$di/METADATA"
printf '[vllm.general_plugins]\nadp_kv_connector = adp_connector.vllm:register\n' > "$di/entry_points.txt"
export PYTHONPATH="/tmp/site-adp:${PYTHONPATH:-}:$root/wire/src:$root/connector/src:$root/emulator/src:$root/testbed/src"
export PYTHONHASHSEED=0 ADP_KV_CACHE=/tmp/adp-kv-cache PATH="/tmp/site-adp/bin:$PATH"
# the GDN FlashInfer set (requirements-gdn-flashinfer-vllm-0.26.0.txt): cutlass-dsl's packages come in through a .pth
# file (nvidia_cutlass_dsl_packages.pth), which Python reads only in site-packages, not on PYTHONPATH
for dsl in "${VLLM_GPU_SITE:-/tmp/site}"/nvidia_cutlass_dsl/dsl_packages; do
  [ -d "$dsl" ] && export PYTHONPATH="$dsl:$PYTHONPATH"  # first, as the .pth puts it
done
case "$what" in
  gpu-unit)  # only the connector's GPU data-path tests (a subset of correctness), and the vLLM-free pipelines'
             # tests, whose save tests run on the GPU too (step-wide gathers, pinned slabs)
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 120 python3 -m pytest -q -p no:cacheprovider \
      "$root/connector/tests/vllm/test_vllm_connector_unit.py" -k "gpu or strided" 2>&1 | tail -4 | tee "$out/gpu-unit.txt"
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 180 python3 -m pytest -q -p no:cacheprovider -rs \
      "$root/connector/tests/pipeline" 2>&1 | tail -6 | tee -a "$out/gpu-unit.txt"
    ;;
  scatter)  # the restore's scatter alone (scripts/gpu/scatter_bench.py): both restore-stream priorities, idle and
            # under a compute load; SCATTER_GB bytes per point (default 16), SCATTER_ARGS more options
    # shellcheck disable=SC2086
    timeout 240 python3 "$root/scripts/gpu/scatter_bench.py" --gb "${SCATTER_GB:-16}" ${SCATTER_ARGS:-} --out "$out/scatter.json" \
      > "$out/scatter.txt" 2>&1; echo "scatter rc=$?"; tail -5 "$out/scatter.txt"
    ;;
  correctness)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    python3 -c "import vllm, torch, adp_connector.vllm.connector as c; print('vllm', vllm.__version__, 'torch', torch.__version__, 'legacy', c._check_vllm_version(vllm.__version__))" 2>&1 | tail -1 | tee "$out/versions.txt"
    # the connector's GPU data path (side-stream copies, pinned shared staging, permuted KV views) on this GPU
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 120 python3 -m pytest -q -p no:cacheprovider "$root/connector/tests/vllm/test_vllm_connector_unit.py" \
      -k "gpu or strided" 2>&1 | tail -4 | tee "$out/gpu-unit.txt"
    timeout 330 python3 -m adp_testbed.cli verify --family dense --json > "$out/verify-dense.json" 2> "$out/verify-dense.log"
    echo "verify dense rc=$?"; cat "$out/verify-dense.json"; tail -5 "$out/verify-dense.log"
    [ "${DATAPATH:-1}" = 0 ] && exit 0
    timeout 120 python3 -m adp_testbed.cli bench datapath --sizes 1M --queues 1,4,8,16 --depths 32 --patterns seq \
      --ops read --seconds 2 --mdts 1M --working-set 2G --json "$out/datapath.json" > "$out/datapath.txt" 2>&1
    echo "datapath rc=$?"; tail -25 "$out/datapath.txt"
    ;;
  datapath)  # issue #7 item 6: client reads 1..16 queues into pinned memory and on into GPU memory, target
             # with 0 / 4 / 8 I/O worker processes, stream ceiling in the same run
    timeout 300 python3 -m adp_testbed.cli bench datapath --sizes 1M --queues 1,4,8,16 --depths 32 --patterns seq \
      --ops read --seconds 2 --mdts 1M --working-set 2G --target-workers ${TARGET_WORKERS:-0,4,8} --into gpu \
      --json "$out/datapath.json" > "$out/datapath.txt" 2>&1
    echo "datapath rc=$?"; grep -v '^ \|^{\|^}' "$out/datapath.txt" | tail -20
    ;;
  restore-path)  # the connector's restore machinery without vLLM: helpers x target workers, into GPU memory,
                 # sampled by py-spy (every process: bench, target, its workers, the helpers)
    py-spy record --subprocesses -r 50 -f raw ${PYSPY_ARGS:---nonblocking} -o "$out/restore-path.pyspy.txt" -- \
      python3 -m adp_testbed.cli bench restore-path --into gpu --json "$out/restore-path.json" \
      ${RESTORE_ARGS:---gb 8 --helpers 1,2,4,8 --target-workers 4,8} > "$out/restore-path.txt" 2>&1
    echo "restore-path rc=$?"; grep -v "^py-spy\|^Sampling\|^Stopped\|^Wrote" "$out/restore-path.txt" | tail -12
    gzip -f "$out/restore-path.pyspy.txt"
    ;;
  families)  # issue #7 item 1 / issue 16: `testbed verify` per family (random weights, cold -> restart -> warm,
             # every restored page compared); mtp also measures acceptance with the connector off / saving / restoring.
             # FAMILIES entries: family[:variant][+control]: swa:mistral = the all-SWA model; +corrupt = the negative
             # control that corrupts every stored page (--corrupt-pages), +corrupt-states only the recurrent states
             # (--corrupt-state-pages); both must FAIL. dsa checks that the compared pages hold the indexer keys.
             # gdn entries add GDN_ARGS (default: the triton prefill, the wheel set has no flashinfer).
             # Each summary-<tag>.txt also keeps the engine logs' connector lines (restore failures with their
             # cause, restores not planned and why; FAMILY_LOG_LINES per engine, default 40) and vLLM's block /
             # Mamba page choices: for mamba/gdn on 0.26 read them with load_fallbacks, pages_compared_by_group
             # (one state per group and prompt), reference_local_hits (vLLM's own hit, must equal warm_hits) and
             # expected_hits_rule.
             # FAMILY_JOBS=N runs N entries at once on the one GPU (each engine then gets
             # gpu_memory_utilization FAMILY_GPU_SHARE, default 0.9/N: the models are tiny, the KV cache 256 MiB;
             # and staging_mb 1024).
    jobs=${FAMILY_JOBS:-1}
    share=${FAMILY_GPU_SHARE:-$(python3 -c "print(round(0.9 / $jobs, 3))")}
    one_family() {  # entry -> verify-<tag>.json/.log, then a one-line summary
      local entry=$1 control="" fam variant tag extra
      case "$entry" in *+*) control=${entry#*+}; entry=${entry%%+*} ;; esac
      fam=${entry%%:*}; variant=""; [ "$fam" != "$entry" ] && variant=${entry#*:}
      tag=$fam${variant:+-$variant}${control:+-$control}
      extra=""
      [ -n "$variant" ] && extra="--variant $variant"
      [ "$fam" = mtp ] && extra="--prompts 4 --max-tokens ${MTP_TOKENS:-128}"
      [ "$fam" = gdn ] && extra="$extra ${GDN_ARGS---engine-kwarg gdn_prefill_backend=triton}"
      [ "$control" = corrupt ] && extra="$extra --corrupt-pages"
      [ "$control" = corrupt-states ] && extra="$extra --corrupt-state-pages"
      # several at once: a share of the GPU each, and 1 GiB of pinned staging (the host default, RAM / 16, times
      # N engines would pin half the host's memory; a verify restores a few MB)
      [ "$jobs" -gt 1 ] && extra="$extra --engine-kwarg gpu_memory_utilization=$share --connector-opt staging_mb=1024"
      rm -rf "/tmp/verify-$tag"  # a fresh card per run: a card left by an earlier call would make the cold run hit
      local t0=$SECONDS
      timeout "${FAMILY_TIMEOUT:-420}" python3 -m adp_testbed.cli verify --family "$fam" $extra ${VERIFY_ARGS:-} \
        --workdir "/tmp/verify-$tag" --json "$out/verify-$tag.json" > "$out/verify-$tag.log" 2>&1
      local rc=$?
      {
        echo "verify $tag rc=$rc ($((SECONDS - t0)) s)"
        python3 -c "import json,sys; v=json.load(open(sys.argv[1])); print({k: v.get(k) for k in ('ok',
          'outputs_identical', 'warm_hits', 'expected_warm_hits', 'expected_hits_rule', 'reference_local_hits',
          'block_size', 'pages_saved', 'pages_compared', 'pages_mismatched', 'pages_compared_by_group',
          'load_fallbacks', 'verify_failures', 'logprob_max_abs_diff', 'groups', 'dsa', 'acceptance',
          'negative_control', 'error', 'reason')})" \
          "$out/verify-$tag.json" 2>&1 | tail -2
        grep -h "Error\|error\|slot table" "/tmp/verify-$tag/engines/"engine-*.log 2>/dev/null | grep -v "^$" | tail -3
        # the engine logs stay on the GPU host: keep what explains a restore (each fallback's cause, a restore
        # the scheduler could not plan and why), the connector's groups, and vLLM's block / Mamba page choices
        echo "engine log lines (connector restores/saves, vLLM block and Mamba page sizes):"
        for f in "/tmp/verify-$tag/engines/"engine-*.log; do
          [ -f "$f" ] || continue
          grep -h "ADP KV\|restore of\|Setting attention block size\|Padding mamba page size\|mamba_cache_mode\|mamba_block_size" "$f" \
            | cut -c1-600 | tail -${FAMILY_LOG_LINES:-40} | sed "s|^|  $(basename "$f"): |"
        done
      } > "$out/summary-$tag.txt"
      cat "$out/summary-$tag.txt"
    }
    running=0
    for entry in ${FAMILIES:-swa swa:mistral mla dsa mtp}; do
      if [ "$jobs" -gt 1 ]; then
        one_family "$entry" &
        running=$((running + 1))
        if [ "$running" -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
      else
        one_family "$entry"
      fi
    done
    wait
    ;;
  restart)
    python3 "$root/scripts/gpu/restart_ttft.py" --out "$out" ${RESTART_ARGS:-}
    ;;
  agents|sweep)
    # the dummy model's positions: at least 131072 (restart_ttft.write_model); MODEL_LEN for longer contexts
    model=$(python3 "$root/scripts/gpu/restart_ttft.py" --model-only --out "$out" --lengths ${MODEL_LEN:-65536})
    python3 -m adp_testbed.cli bench "$what" --preset gpu --model "$model" --engine-arg=--load-format=dummy \
      --arms baseline,cpu-offload,adp --vllm-python python3 --out "$out/$what" ${BENCH_ARGS:-}
    ;;
  *) echo "unknown: $what" >&2; exit 2 ;;
esac
