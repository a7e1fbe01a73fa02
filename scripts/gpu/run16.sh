#!/usr/bin/env bash
# The H200 runs since run 15's plan (run 16 ran x c f k s e u: docs/benchmarks.md "Run 16"). Each step is a letter;
# STEPS picks them, in the order given (default: all, the most wanted first, about 50 minutes on a warm machine, more
# than one session's 30). Each step archives itself as /root/part-X.tgz as it ends.
#   u  the pipelines' tests on CUDA                     s  the scatter under a Python load at three switch intervals
#   x  8 agents, adp and cpu-offload, equal 64 GiB     f  adp at 8 agents, switch_interval_ms=0.5, lock-holder profile
#   c  16 agents, 16 GiB CPU tier, 96 GiB card, 3 arms   k  8 agents, no connector, a GPU cache that holds every history
#   l  16 agents (c's histories), no connector, a GPU cache that holds every history
#   b  agents 1, 4, 8, three arms                       d  the sweep to 128 users
#   o  1 agent, no connector and adp (the 2% cost gate; results.json keeps the connector's time in each vLLM hook)
#   v  16 agents (c's histories) on a 32 GiB card, below their ~52 GB: adp with the segmented LRU (the default)
#   w  the same with eviction=lru (v against w: what keeping the pages read back is worth when the card is full)
#   n  GDN (Qwen3-Next) on FlashInfer's GDN prefill, vLLM 0.26's default on SM90, with its corrupted-state control:
#      needs the GDN wheel set (.vllm-gpu-gdn: 10 chunks, a superset of the base set; docs/connector.md)
#   e  the restore path over 16 GB, splice and copy     g  adp at 8 agents under py-spy (active threads)
#   h  adp at 8 agents, the card at MDTS 128K
#   a  every family with its negative control on the vLLM installed, and the GPU unit tests (run 19: vLLM 0.33.0,
#      with the 0.33 wheel set: scripts/gpu/requirements-vllm-0.33.0.txt, 60 chunks of 46 MB)
#   m  MTP on the vLLM installed (its control is built in: acceptance with the drafter's KV zeroed; run 20 also
#      listed mtp+corrupt, which testbed verify refuses)
#   y  v with every new page admitted into the full card (admission=always: the order alone), v's control
#   r  the restore path into GPU memory as the connector runs it (driver thread, 1 and 5 GB restores, 32 layers)
#   p  the sweep's 192-user point alone under py-spy --gil (who holds each process's interpreter lock)
#   i  the same point under py-spy --idle (where the engine thread waits inside the connector's hooks)
#   j  adp at 8 agents under py-spy --idle (where wait_for_save and the restores' phases spend their time)
#   z  adp at 8 agents with read_ahead_mb=0 (b's adp arm without the read-ahead: what it is worth, same machine)
#   t  16 agents (40k-token histories, ~97 GB of KV) over equal 64 GiB budgets, three arms; T the same, cpu-offload
#      alone with vLLM's ARC policy (eviction_policy=arc)
#   C  16 agents (30k-token histories, 5 turns) on a 16 GiB CPU tier and a 96 GiB card: adp and cpu-offload
#   E  the restore path over 16 GB, splice and copy (issue 15's 20 GB/s and 0.25 core-s/GB)
#   F  t with two arms, cpu-offload and adp
#   G  C with 6 turns and all three arms (C's cold first turn weighs less; the gate asks for the no-connector arm)
#   L  the restore path over 16 GB at 8, 12 and 16 helpers, splice reads: the landing across staging on this host
#   H  8 agents at 64k-token histories (~73 GB of KV, over the equal 64 GiB budgets), three arms: the equal-budget
#      gate's 8-agent point at a shape whose ceiling is above 3x (40k histories: 21.8 / 8.3 = 2.6x with no eviction)
#   M  L's 12 helpers with a staging of 16 slabs of 2 MiB (in the host's cache): run 29, no cheaper in all
#   N  8 agents at 96k-token histories (~106 GB of KV over the equal 64 GiB budgets: 8 agents evict), 3 arms, 3 turns
#   K  the sweep with 16k-token documents to 128 users (8k documents: a restore saves a third of a prefill)
#   W  R with two more warm engines at 24 and 48 restore batches in flight (the default is 96) and each prompt's
#      restore phases (stats_path): where run 28's 70-120 ms beyond the restore path's own rate go
#   R  the restart at 32k and 100k tokens, no connector, adp cold and warm (issue 15's 0.25x / 0.15x and 3%)
#   q  the sweep's warm-up burst and first points with the derived room for saves waiting for staging (run 22's
#      warm-up dropped 21% of its pages with the old derived 8 GiB; run 23 set 24 GiB by hand: Q_ARGS)
# The base wheel set is enough:
#   ../shared/gpu/prepare-wheels --chunk-mb 50   (8 chunks: with the checkout a 60 MB chunk is over 64 MiB),
#   plus .whl (validate.sh's header says which wheels)
# Start it in the background after the chunks, from a copy of the tree (each call lays the checkout anew, so a job
# that outlives its call must not run from it), then collect /root/part-*.tgz with wait calls issued back to back (a
# gap over 30 s gives the machine back; bg.sh wait then fails at once with status 4 instead of waiting on nothing):
#   source .vllm-gpu/bin/device-install.sh && rm -rf /root/tree && cp -a . /root/tree && cd /root/tree &&
#     STEPS="c l" bash scripts/gpu/bg.sh start run16 bash scripts/gpu/run16.sh
#   bash scripts/gpu/bg.sh wait run16 540; cp /root/part-*.tgz "$OUT"/
# A step archives itself only when it ends: in the last wait call also take what the running step has written so far
# (the bench's results.partial.json holds every point it finished; run 21 lost a sweep's TTFTs without it):
#   tar czf "$OUT"/partial.tgz -C /root/res . 2>/dev/null; cp /root/bg/run16.log "$OUT"/
# RUN16_TAG=T keeps a second tree's results apart (an A/B of two trees on one machine): $R becomes /root/res-T and the
# archives /root/part-T-X.tgz. SWEEP_USERS sets step d's user counts (default 1,16,64,128).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
tag=${RUN16_TAG:+${RUN16_TAG}-}
R=/root/res${RUN16_TAG:+-$RUN16_TAG}
mkdir -p $R
export TMPDIR=/dev/shm
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep "Model name"; free -g;
  uname -r;  # the host's kernel: Firecracker's Linux or gVisor's (4.4.0) moves loopback TCP differently
  df -h /dev/shm /tmp;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  env -u PYTHONPATH python3 -m pip list 2>/dev/null | grep -iE '^(nvidia|cuda|torch|triton)'; } \
  > $R/host.txt 2>&1
v="bash $root/scripts/gpu/validate.sh"
A8="--agents 8 --turns 4 --target-workers 8 --card-bytes 64G"
step() {  # step LETTER: run it, then archive what it wrote (with host.txt) as /root/part-LETTER.tgz
  echo "== $1 $(date +%T)"
  case "$1" in
    # the pipelines' tests on CUDA
    u) $v gpu-unit $R/u ;;
    # the scatter under a Python load at three interpreter switch intervals (run 14: the fused copy moved 0.67 GB/s
    # there at Python's default 5 ms: does a shorter interval free the restore driver?)
    s) SCATTER_GB=16 SCATTER_ARGS="--max-seconds 10 --switch-intervals 0.005,0.001,0.0002" $v scatter $R/s ;;
    # issue 14: 8 agents at equal 64 GiB budgets, adp and cpu-offload in one run (run 14: 14.6 against 18.3 tok/s)
    x) BENCH_ARGS="$A8 --arms adp,cpu-offload --offload-bytes 64G" $v agents $R/x ;;
    # issue 14: the adp arm at 8 agents with the engine's switch interval at 0.5 ms, py-spy sampling only the thread
    # that holds the interpreter lock (what holds the engine process's lock while the restore driver waits for it)
    f) BENCH_ARGS="$A8 --arms adp --connector-opt switch_interval_ms=0.5 --profile adp --profile-gil" \
         $v agents $R/f ;;
    # issue 14: 16 agents with a CPU tier below their working set (16 x 20k-token histories and 3 turns of 1.5k:
    # ~52 GB of KV) while the card holds it (run 16 ran adp and cpu-offload: 1.58x, 643 saves dropped)
    c) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp,cpu-offload,baseline --target-workers 8 \
--card-bytes 96G --offload-bytes 16G" $v agents $R/c ;;
    # issue 14: the ceiling at 16 agents (is 2x cpu-offload below it?)
    l) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms baseline --kv-cache-bytes 80G" $v agents $R/l ;;
    # issue 14: the ceiling at 8 agents: no connector with a GPU KV cache that holds all 8 histories (~48 GB), so
    # nothing is evicted; no tier can make the 8-agent run faster than this
    k) BENCH_ARGS="--agents 8 --turns 4 --arms baseline --kv-cache-bytes 80G" $v agents $R/k ;;
    # issue 14: agents 1, 4 and 8 at equal budgets, three arms (the 1-agent cost gate)
    b) BENCH_ARGS="--agents 1,4,8 --turns 4 --arms adp,baseline,cpu-offload --target-workers 8 --card-bytes 64G \
--offload-bytes 64G" $v agents $R/b ;;
    # issue 14: the connector's cost with nothing to gain (1 agent: nothing is evicted), no connector and adp
    o) BENCH_ARGS="--agents 1 --turns 4 --arms baseline,adp --target-workers 8 --card-bytes 64G" $v agents $R/o ;;
    # issue 16: GDN with FlashInfer's prefill (GDN_ARGS empty: vLLM's default backend), the kernel JIT-compiled at
    # the first prefill
    n) GDN_ARGS="" FAMILY_JOBS=2 FAMILY_TIMEOUT=540 FAMILIES="gdn gdn+corrupt-states" $v families $R/n ;;
    # issue 14: a card smaller than the 16 agents' working set, eviction slru (default) and lru
    v) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp --target-workers 8 --card-bytes 32G" \
         $v agents $R/v ;;
    w) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp --target-workers 8 --card-bytes 32G \
--connector-opt eviction=lru" $v agents $R/w ;;
    y) BENCH_ARGS="--agents 16 --history-len 20000 --turns 3 --arms adp --target-workers 8 --card-bytes 32G \
--connector-opt admission=always" $v agents $R/y ;;
    # issue 14: the sweep with the defaults, to 128 users, on a 96 GiB card: the preset's 512 GiB does not fit in
    # /dev/shm on this 125 GiB host (run 21's 192-user point stalled the host at ~112 GiB written). Run 17 wrote 107 GB
    # to 128 users on a card that never filled: here the top points run on a full card, under admission
    d) BENCH_ARGS="--users ${SWEEP_USERS:-1,16,64,128} --arms baseline,adp --target-workers 8 --card-bytes 96G" \
         $v sweep $R/d ;;
    # issue 14 item 4: run 22's warm-up offered 3.4 GB/s for 15 s against 2.7 written and dropped 5,052 pages once
    # the 8 GiB of waiting saves' copies (save_spill_mb, then derived as min(8 GiB, a quarter of the free GPU memory))
    # filled; run 23 held it with save_spill_mb=24576 set by hand. Since d71e99b the derived default is min(24 GiB, half
    # of the free GPU memory): does it hold the burst with no option? (Q_ARGS adds options, e.g. run 23's by hand)
    q) BENCH_ARGS="--users 1,16 --arms adp --target-workers 8 --card-bytes 96G ${Q_ARGS:-}" $v sweep $R/q ;;
    # issue 14/15: the sweep's 192-user point alone (after its warm-up), adp, with py-spy sampling only the thread
    # that holds each process's interpreter lock: run 22 restored 571 GB there at 7.0 GB/s against 12-14 on the
    # restore-path bench; does the engine's step loop hold the lock the restore driver and the store proxy need?
    p) BENCH_ARGS="--users 192 --arms adp --target-workers 8 --card-bytes 96G --profile adp --profile-gil" \
         $v sweep $R/p ;;
    # issue 15: the restore path over 16 GB per point, splice against copy, 12 helpers of 2 queues, each also beside
    # a Python thread at 5 and 0.5 ms switch intervals (the engine's step loop beside the restore driver)
    e) RESTORE_ARGS="--gb 16 --helpers 12 --queues 2 --target-workers 8 --target-reads splice,copy \
--python-load 0.005,0.0005" $v restore-path $R/e ;;
    # issue 14: the same point under py-spy --idle: run 23's hooks took 31 ms per request there, 23.8 s of the point's
    # 97 on the engine thread, holding its lock for less than half of that; where does the rest wait?
    i) BENCH_ARGS="--users 192 --arms adp --target-workers 8 --card-bytes 96G --profile adp --profile-idle" \
         $v sweep $R/i ;;
    # issue 15 item 4: the restore path as the connector runs it in vLLM, against the bench's old mode. Run 23: 1 GB
    # restores one at a time at 4-5.5 GB/s and 5 GB ones at 6-7.6 in the engine, against 13.85 GB/s for one 16 GB
    # restore polled in a loop (run 16). Which of the driver thread, the restore size and the 32 layers' scatter costs it?
    r) mkdir -p $R/r
       RP="--gb 16 --helpers 12 --queues 2 --target-workers 8"  # validate.sh adds --into gpu
       for c in "poll 0 1" "thread 0 32" "thread 5 32" "thread 1 32" "poll 1 32"; do
         read -r drv gb ly <<< "$c"  # not set --: step's own $1 names the archive (run 24 archived r as part-poll)
         RESTORE_ARGS="$RP --driver $drv --restore-gb $gb --layers $ly" $v restore-path $R/r/$drv-${gb}gb-${ly}l
       done ;;
    # issue 14/15: the adp arm at 8 agents under py-spy --idle. Run 23: wait_for_save held the engine thread 11.5 s of
    # the 45 s point, and 17 restores of ~5 GB ran at 6.2-7.6 GB/s; the engine log's restore_*_ms and the results'
    # adp_kv_restore_phase_seconds split each restore into queued, io (slab_wait within), copy and step_wait
    j) BENCH_ARGS="$A8 --arms adp --profile adp --profile-idle" $v agents $R/j ;;
    # issue 14: b's adp arm at 8 agents without the read-ahead (read_ahead_mb=0), its control on the same machine
    z) BENCH_ARGS="$A8 --arms adp --connector-opt read_ahead_mb=0" $v agents $R/z ;;
    # issue 14/15: the adp arm at 8 agents with py-spy on the engine's process tree (active threads)
    g) BENCH_ARGS="$A8 --arms adp --profile adp" $v agents $R/g ;;
    # the MDTS A/B: the adp arm at 8 agents with the old 128K card, on the same machine
    h) BENCH_ARGS="$A8 --arms adp --target-mdts 128K" $v agents $R/h ;;
    # issue 16: every family with its negative control on the vLLM installed (run 19: 0.33.0 from
    # requirements-vllm-0.33.0.txt), 7 at once, the GPU unit tests beside them (the fused page copy on its Triton)
    a) mkdir -p $R/a
       python3 -c "import vllm, torch, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'triton',
triton.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())" > $R/a/versions.txt 2>&1
       $v gpu-unit $R/a/unit > /dev/null 2>&1 &
       GDN_ARGS="" FAMILY_JOBS=7 FAMILY_TIMEOUT=480 FAMILIES="mtp gdn mamba dsa mla swa swa:mistral dense \
gdn+corrupt-states mamba+corrupt-states dsa+corrupt mla+corrupt swa+corrupt dense+corrupt" $v families $R/a/families
       wait ;;
    m) FAMILIES="mtp" $v families $R/m ;;
    # issue 14: the equal-budget gate's 16-agent point (40k-token histories, 4 turns: ~97 GB of KV over the 64 GiB
    # card and CPU tier). Runs 7 and 8 ran it before the card had frequency admission: both tiers thrashed (cpu-offload
    # restored nothing, adp 1.03-1.06x). Three arms, ~11 min on a warm machine (an estimate from those runs)
    t) BENCH_ARGS="--agents 16 --turns 4 --arms baseline,cpu-offload,adp --target-workers 8 --card-bytes 64G \
--offload-bytes 64G" $v agents $R/t ;;
    # the same, cpu-offload alone with vLLM's ARC policy (t's runs vLLM's default, LRU), ~4 min
    T) BENCH_ARGS="--agents 16 --turns 4 --arms cpu-offload --offload-bytes 64G --offload-opt eviction_policy=arc" \
         $v agents $R/T ;;
    # issue 14: the small-tier gate at a prefill that costs more than run 26's 20k histories (16 agents, 30k-token
    # histories, 5 turns: ~80 GB of KV; the card holds it, the 16 GiB CPU tier does not), adp against cpu-offload
    C) BENCH_ARGS="--agents 16 --history-len 30000 --turns 5 --arms adp,cpu-offload --target-workers 8 \
--card-bytes 96G --offload-bytes 16G" $v agents $R/C ;;
    # C with a sixth turn and the no-connector arm: run 28's C spent 17 s per agent in its cold first turn in both
    # arms, then ~9 s (adp) against ~24 s (cpu-offload) a turn; ~14 min on a warm machine
    G) BENCH_ARGS="--agents 16 --history-len 30000 --turns 6 --arms adp,cpu-offload,baseline --target-workers 8 \
--card-bytes 96G --offload-bytes 16G" $v agents $R/G ;;
    # the restore path's helpers against the same streams landing across the staging arena (landing_* in each row:
    # what the kernel's receive copy into cold host memory costs here, the floor of any TCP client), ~2 min
    L) RESTORE_ARGS="--gb 16 --helpers 8,12,16 --queues 2 --target-workers 8 --target-reads splice" \
         $v restore-path $R/L ;;
    # L's 12 helpers with a staging arena small enough to stay in the host's cache (16 slabs of 2 MiB): does a receive
    # into cached staging cost less than one into 64 MiB slabs (dev VM: no, 0.51 against 0.35-0.48 core-s/GB)? ~1 min
    M) RESTORE_ARGS="--gb 16 --helpers 12 --queues 2 --target-workers 8 --target-reads splice --batch-mb 2 --slabs 16" \
         $v restore-path $R/M ;;
    # issue 14's equal-budget gate at 8 agents with histories long enough that a perfect cache could give 3x (a
    # recompute grows faster with the history than a decode does); ~10 min (an estimate)
    H) BENCH_ARGS="--agents 8 --history-len 64000 --turns 4 --max-model-len 80000 \
--arms baseline,cpu-offload,adp --target-workers 8 --card-bytes 64G --offload-bytes 64G" $v agents $R/H ;;
    # issue 14's equal-budget gate at 8 agents sized so that 8 agents evict: 96k-token histories, ~106 GB of KV over
    # the 64 GiB card and CPU tier (run 29's 64k histories, ~72 GB, barely did: both tiers held them all and the GPU
    # cache's decodes set the pace). Which histories each tier keeps decides it, as at 16 agents (run 16: 1.58x);
    # 3 turns to keep it near 14 min (an estimate from run 29's 64k point)
    N) BENCH_ARGS="--agents 8 --history-len 96000 --turns 3 --max-model-len 110000 \
--arms baseline,cpu-offload,adp --target-workers 8 --card-bytes 64G --offload-bytes 64G" $v agents $R/N ;;
    # issue 14's sweep with 16k-token documents (16 of them, ~34 GB, on a 96 GiB card), 2 requests per user to keep the
    # baseline's top point near 4 min; ~12 min (an estimate)
    K) BENCH_ARGS="--users 1,16,64,128 --requests-per-user 2 --contexts 16 --context-len 16000 --arms baseline,adp \
--target-workers 8 --card-bytes 96G" $v sweep $R/K ;;
    # t without the no-connector arm (cpu-offload restores nothing there in runs 7 and 8, so it stands near it), ~7 min
    F) BENCH_ARGS="--agents 16 --turns 4 --arms cpu-offload,adp --target-workers 8 --card-bytes 64G \
--offload-bytes 64G" $v agents $R/F ;;
    # issue 15's gates on this host, as they stand: the restore path over 16 GB into GPU memory (12 helpers of 2
    # queues, 8 target workers, splice and copy reads; run 16 on an H200: 13.85 / 11.80 GB/s, helpers 0.72 / 0.63
    # core-s/GB, ceilings 13.3 / 20.2; the save path with 1, 2 and 4 writer processes, item 5), and the restart at 32k
    # and 100k tokens (run 13: 0.355x / 0.197x of the prefill, gates 0.25x / 0.15x; the cold pass +4.1% at 32k, gate 3%)
    E) RESTORE_ARGS="--gb 16 --helpers 12 --queues 2 --target-workers 8 --target-reads splice,copy \
--save-processes 1,2,4" $v restore-path $R/E ;;
    W) RESTART_ARGS="--lengths 32000,100000 --target-workers 8 --arms baseline,adp-cold,adp-warm \
--warm-variant b24:restore_batches=24 --warm-variant b48:restore_batches=48" $v restart $R/W ;;
    R) RESTART_ARGS="--lengths 32000,100000 --target-workers 8 --arms baseline,adp-cold,adp-warm" $v restart $R/R ;;
    *) echo "run16: unknown step $1" >&2; return 2 ;;
  esac
  (cd $R && tar czf /root/part-$tag$1.tgz host.txt "$1")
}
for s in ${STEPS:-o v w b e c l x k d u s f g h}; do step "$s"; done
echo "== done $(date +%T)"
