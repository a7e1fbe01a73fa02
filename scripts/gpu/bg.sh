#!/usr/bin/env bash
# A GPU run longer than one device call (10 min): started in its own session so it outlives the call that started
# it; the next calls, issued back to back (the machine is given back after ~30 s idle), wait on it.
#   bash scripts/gpu/bg.sh start NAME CMD...   returns at once; output in $BG_DIR/NAME.log, exit status in NAME.rc
#   bash scripts/gpu/bg.sh wait NAME SECONDS   waits up to SECONDS; prints the log's tail; status 0 once it ended,
#                                              3 while it runs, 4 at once where NAME never started (a fresh machine)
#   bash scripts/gpu/bg.sh stop NAME           ends it (its whole process group)
set -u
dir=${BG_DIR:-/root/bg}
mkdir -p "$dir"
verb=${1:?start, wait or stop}
name=${2:?name}
case "$verb" in
  start)
    shift 2
    rm -f "$dir/$name.rc"
    setsid bash -c '"$@" > "$0.log" 2>&1 < /dev/null; echo $? > "$0.rc"' "$dir/$name" "$@" > /dev/null 2>&1 < /dev/null &
    echo $! > "$dir/$name.pid"
    echo "bg: $name started (pid $(cat "$dir/$name.pid"))"
    ;;
  wait)
    limit=${3:?seconds}
    if [ ! -f "$dir/$name.pid" ]; then
      # a fresh machine (the previous one was given back while idle): nothing to wait for, and waiting would only
      # spend device time (run 14 lost 540 s that way)
      echo "bg: no job $name on this machine (it was restarted: the run and its results are gone)" >&2; exit 4
    fi
    end=$((SECONDS + limit))
    while [ ! -f "$dir/$name.rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    tail -n "${BG_TAIL:-15}" "$dir/$name.log" 2>/dev/null
    if [ -f "$dir/$name.rc" ]; then echo "bg: $name ended with status $(cat "$dir/$name.rc")"; exit 0; fi
    echo "bg: $name still running"; exit 3
    ;;
  stop)
    kill -- -"$(cat "$dir/$name.pid")" 2>/dev/null; echo "bg: $name stopped"
    ;;
  *) echo "bg: unknown verb $verb" >&2; exit 2 ;;
esac
