#!/usr/bin/env bash
# Issue 22's M1 and M2, measured as a user sees them: a keyed head with no denoiser (-e 1 -d 0 -k 1).
#   M2: `disagg status` without --keys, 10 runs: exit status and seconds (before: 1 run in 6-10 hung forever)
#   M1: 5 generations over HTTP while no denoiser exists: status code and seconds (before: the 600 s timeout)
# Usage: bash benchmarks/newcomer_checks.sh [PORT] [HTTP_PORT]   (run from the repository root)
set -u
P=${1:-27555}; H=${2:-27600}; D=$(mktemp -d)
python -m disagg keys generate "$D/keys" >/dev/null
python -m disagg launch --model payload --port "$P" --keys "$D/keys" -e 1 -d 0 -k 1 --join-wait 2 --http-port "$H" \
  --spares 0 --no-dashboard --run-dir "$D/run" > "$D/launch.log" 2>&1 &
LP=$!
trap 'kill -INT $LP 2>/dev/null; wait $LP; rm -rf "$D"' EXIT
for _ in $(seq 60); do python -m disagg status --endpoint "tcp://127.0.0.1:$P" --keys "$D/keys" >/dev/null 2>&1 && break; sleep 1; done
sleep 3  # past --join-wait
echo "M2: status without --keys (exit status, seconds)"
for _ in $(seq 10); do
  s=$(date +%s.%N); timeout 40 python -m disagg status --endpoint "tcp://127.0.0.1:$P" >/dev/null 2>&1; rc=$?
  printf "%s %.2f\n" "$rc" "$(echo "$(date +%s.%N) - $s" | bc)"
done
echo "M1: a generation with no denoiser (HTTP status, seconds)"
for _ in $(seq 5); do
  curl -s -o /dev/null -w "%{http_code} %{time_total}\n" -m 30 "localhost:$H/v1/images/generations" \
    -H 'Content-Type: application/json' -d '{"prompt":"x","size":"64x64"}'
done
curl -s "localhost:$H/health"; echo
