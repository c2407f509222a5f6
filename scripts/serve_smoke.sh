#!/usr/bin/env bash
# `make serve` from a fresh copy of this checkout (its own venv, install, model fetch), answered by one chat
# request within a bounded wait, then stopped with Ctrl-C as a person would, and everything it started with it.
# The copy holds the working tree as it is, uncommitted changes included (the files git tracks or would track);
# SMOKE_FROM=head takes a `git clone` of the last commit instead.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# Free ports by default, so a server already on 8000/8265/8080 does not get in the way.
HTTP_PORT="${SMOKE_HTTP_PORT:-$(free_port)}"
DASHBOARD_PORT="${SMOKE_DASHBOARD_PORT:-$(free_port)}"
METRICS_PORT="${SMOKE_METRICS_PORT:-$(free_port)}"
BUDGET_S="${SMOKE_BUDGET_S:-1500}"  # a fresh venv installs torch and ray first
WORK="$(mktemp -d /tmp/tokenline-smoke.XXXXXX)"
SERVE_PID=""

stop_serve() {
  [ -n "$SERVE_PID" ] || return 0
  kill -INT -- "-$SERVE_PID" 2>/dev/null || true  # the whole process group: make, python, Ray
  for _ in $(seq 1 60); do
    kill -0 -- "-$SERVE_PID" 2>/dev/null || { SERVE_PID=""; return 0; }
    sleep 1
  done
  echo "serve-smoke: still running after Ctrl-C; terminating" >&2
  kill -TERM -- "-$SERVE_PID" 2>/dev/null || true
  sleep 5
  kill -KILL -- "-$SERVE_PID" 2>/dev/null || true
  SERVE_PID=""
}
cleanup() { stop_serve; rm -rf "$WORK"; }
trap cleanup EXIT

copy_worktree() {
  mkdir -p "$WORK/tokenline"
  if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # Tracked files and new ones git does not ignore; a tracked file deleted in the tree is left out.
    (cd "$ROOT" && git ls-files -z -co --exclude-standard | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) \
      | tar -xf - -C "$WORK/tokenline"
  else
    tar -C "$ROOT" --exclude=.venv --exclude=results --exclude=__pycache__ -cf - . | tar -xf - -C "$WORK/tokenline"
  fi
}
if [ "${SMOKE_FROM:-worktree}" = head ]; then
  git clone -q "$ROOT" "$WORK/tokenline"
else
  copy_worktree
fi
cd "$WORK/tokenline"
echo "serve-smoke: make serve in $WORK/tokenline (log: $WORK/serve.log)"
setsid make serve HTTP_PORT="$HTTP_PORT" DASHBOARD_PORT="$DASHBOARD_PORT" METRICS_PORT="$METRICS_PORT" \
  >"$WORK/serve.log" 2>&1 &
SERVE_PID=$!

REQUEST='{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}'
START=$SECONDS
until curl -sf -m 60 "http://127.0.0.1:$HTTP_PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "$REQUEST" -o "$WORK/answer.json"; do
  if ! kill -0 "$SERVE_PID" 2>/dev/null; then
    echo "serve-smoke: make serve exited before answering" >&2; tail -40 "$WORK/serve.log" >&2; exit 1
  fi
  if (( SECONDS - START > BUDGET_S )); then
    echo "serve-smoke: no answer within ${BUDGET_S}s" >&2; tail -40 "$WORK/serve.log" >&2; exit 1
  fi
  sleep 5
done
python3 - "$WORK/answer.json" <<'PY'
import json, sys
answer = json.load(open(sys.argv[1]))
content = answer["choices"][0]["message"]["content"]
assert content.strip(), answer
print(f"serve-smoke: answered in the chat API: {content!r}")
PY
curl -sf -m 10 "http://127.0.0.1:$METRICS_PORT/metrics" -o "$WORK/metrics.txt"
grep -q "^ray_" "$WORK/metrics.txt" && echo "serve-smoke: Ray's metrics served on port $METRICS_PORT"
curl -sf -m 10 -o /dev/null "http://127.0.0.1:$DASHBOARD_PORT/" && echo "serve-smoke: dashboard on port $DASHBOARD_PORT"
grep -q "Ray dashboard: http://127.0.0.1:$DASHBOARD_PORT" "$WORK/serve.log" \
  || { echo "serve-smoke: make serve did not print the dashboard's address" >&2; exit 1; }
# Ray's token auth (on by default): the REST API answers with the token `make serve` pointed to.
TOKEN="$(.venv/bin/ray get-auth-token 2>/dev/null || true)"
curl -sf -m 10 -o /dev/null -H "Authorization: Bearer $TOKEN" "http://127.0.0.1:$DASHBOARD_PORT/api/serve/applications/" \
  || { echo "serve-smoke: the dashboard's REST API refused Ray's token" >&2; exit 1; }
echo "serve-smoke: dashboard REST API answered with the token"
# CPU priority: the replicas run ahead of Ray's bookkeeping (deployments/node_priority.py). Everything `make serve`
# started shares its session except `serve run`, which has its own.
python3 - "$SERVE_PID" <<'PY'
import os, sys
session = int(sys.argv[1])
nice = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        continue
    if int(fields[3]) == session:  # field 6: session id
        nice.setdefault(cmd.split("/")[-1], []).append(int(fields[16]))  # field 19: nice
replicas = [n for cmd, ns in nice.items() if cmd.startswith("ray::ServeReplica") for n in ns]
bookkeeping = nice.get("gcs_server", []) + [n for cmd, ns in nice.items() if cmd.startswith("ray::ServeController")
                                            for n in ns]
assert len(replicas) >= 2 and len(bookkeeping) == 2, nice  # the ingress and the engine replica(s)
assert max(replicas) < min(bookkeeping), f"replicas at nice {replicas}, GCS and Serve's controller {bookkeeping}"
print(f"serve-smoke: replicas at nice {sorted(set(replicas))}, GCS and Serve's controller at {sorted(set(bookkeeping))}")
PY
echo "serve-smoke: ready after $((SECONDS - START))s; stopping"
stop_serve
echo "serve-smoke: passed"
