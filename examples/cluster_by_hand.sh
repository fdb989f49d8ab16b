#!/usr/bin/env bash
# A cluster operated by hand, the way a deployment runs it: one Redis, one worker process per EP rank (each with a
# rank agent), a coordinator sidecar, and an operator asking for a round. Then status, audit and a replay.
#
#   examples/cluster_by_hand.sh [REDIS_URL] [TRACE]
#
# REDIS_URL defaults to a redis-server this script starts on 127.0.0.1:6399 (Debian's redis-server must be
# installed); TRACE to the Qwen2-57B dump in ../shared/real_data. Everything it starts is stopped on exit.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
fdeplb=${FDEPLB:-$here/.venv/bin/fdeplb}
python=$(dirname "$fdeplb")/python
trace=${2:-$here/../shared/real_data/qwen2_57b_oeplb/counts57b.json}
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "${own_redis:-}" ] && redis-cli -p 6399 shutdown nosave >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

url=${1:-}
if [ -z "$url" ]; then
  redis-server --port 6399 --bind 127.0.0.1 --save '' --daemonize yes --logfile "$work/redis.log" >/dev/null
  own_redis=1
  url=redis://127.0.0.1:6399/0
  until redis-cli -p 6399 ping >/dev/null 2>&1; do sleep 0.1; done
fi
cluster=example-$$

# a tiny checkpoint with the trace's shape (28 MoE layers x 64 experts for Qwen2-57B), ERNIE tensor names
read -r layers experts < <("$python" -c "
from fdeplb.placement import read_expert_load
t = read_expert_load('$trace'); print(t.num_layers, t.num_logical_experts)")
"$python" -c "
from fdeplb.weights import write_synthetic_checkpoint
write_synthetic_checkpoint('$work/ckpt', $layers, $experts)"

"$fdeplb" init-cluster --redis-url "$url" --cluster "$cluster" --num-layers "$layers" \
  --num-logical-experts "$experts" --num-redundant-experts 8 --ep-size 4 --checkpoint "$work/ckpt"

for r in 0 1 2 3; do
  "$python" -m fdeplb.sim.worker --redis-url "$url" --cluster "$cluster" --rank "$r" --trace "$trace" \
    --log-level WARNING &
  pids+=($!)
done
"$fdeplb" coordinator --redis-url "$url" --cluster "$cluster" --log-level WARNING &
pids+=($!)

"$fdeplb" rearrange --redis-url "$url" --cluster "$cluster" --reason "example"
# wait until round 1 is over (the audit shows DONE -> FREE or an abort); give up after 120 s
for _ in $(seq 1200); do
  if "$fdeplb" audit --redis-url "$url" --cluster "$cluster" --machine cluster --json 2>/dev/null \
      | grep -q '"to": "FREE"'; then break; fi
  sleep 0.1
done
"$fdeplb" status --redis-url "$url" --cluster "$cluster"
"$fdeplb" audit --redis-url "$url" --cluster "$cluster" --machine cluster
"$fdeplb" audit --redis-url "$url" --cluster "$cluster" --export "$work/audit.jsonl"
"$fdeplb" replay "$work/audit.jsonl" --redis-url "$url" --cluster "$cluster"
