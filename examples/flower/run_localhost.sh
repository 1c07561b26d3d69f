#!/usr/bin/env bash
# README.md's walkthrough as one script: certificates, a SuperLink with TLS, NODES SuperNodes
# (one partition each), `flwr run` against the SuperLink, the run's status, result.json; every
# process it started is stopped on the way out, whatever happens. Run it from anywhere with
# Flower and fedppl on PATH (an activated virtual environment):
#
#     bash examples/flower/run_localhost.sh
#     NODES=3 ROUNDS=5 WORK=/tmp/fedppl-tls PORT=9191 bash examples/flower/run_localhost.sh
#
# Each setting below may be given in the environment. Exit status 0 means the run finished as
# completed and wrote result.json (its path is the last line printed).
set -euo pipefail
set -m  # each background process in its own process group, so stopping it stops its children
cd "$(dirname "$0")"

WORK=${WORK:-$PWD}            # holds certificates/, .flwr/, logs/ and result/
PORT=${PORT:-9091}            # the SuperLink's port (its Fleet, Control and runtime APIs)
NODE_PORT=${NODE_PORT:-9094}  # SuperNode k serves its ClientApp worker on NODE_PORT + k
NODES=${NODES:-2}             # SuperNodes, one partition of the data each
ROUNDS=${ROUNDS:-2}
START_TIMEOUT=${START_TIMEOUT:-120}  # seconds for the SuperLink and SuperNodes to come up
RUN_TIMEOUT=${RUN_TIMEOUT:-1800}     # seconds for the run

CERTS=$WORK/certificates
LOGS=$WORK/logs
OUT=$WORK/result
export FLWR_HOME=$WORK/.flwr  # flwr's config.toml, and the app as each process installs it
# optional: a compilation cache shared by the ServerApp and the workers (a second run, or a
# restarted worker, loads its compiled steps from disk)
export JAX_COMPILATION_CACHE_DIR=$WORK/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
mkdir -p "$LOGS" "$FLWR_HOME"
rm -f "$OUT/result.json"

declare -A PIDS=()
stop_all() {  # SIGTERM to each process group, then SIGKILL to what is left after 10 s
    local pid
    disown -a 2>/dev/null || true  # no "Terminated" notice for each
    for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for _ in $(seq 100); do
        local alive=0
        for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
    # the SuperLink starts a run's ServerApp detached (a session of its own); it exits by itself
    # once it sees the SuperLink gone, which a busy one is slow to notice: it is told here
    local ours=(-f -- "--root-certificates $CERTS/ca.crt")
    command -v pkill > /dev/null || return 0
    pkill -TERM "${ours[@]}" 2>/dev/null || return 0
    for _ in $(seq 100); do pgrep "${ours[@]}" > /dev/null || return 0; sleep 0.1; done
    pkill -KILL "${ours[@]}" 2>/dev/null || true
}
trap stop_all EXIT
trap 'exit 130' INT TERM

fail() {
    echo "run_localhost: $1" >&2
    local log
    for log in "$LOGS"/*.log; do
        [ -f "$log" ] && { echo "-- $log (last lines) --" >&2; tail -n 15 "$log" >&2; }
    done
    exit 1
}

wait_for() {  # wait_for LOG PATTERN COUNT WHAT: until PATTERN shows COUNT times in LOG
    local deadline=$((SECONDS + START_TIMEOUT)) n name
    while true; do
        n=$(grep -c "$2" "$1" 2>/dev/null || true)
        [ "${n:-0}" -ge "$3" ] && return 0
        for name in "${!PIDS[@]}"; do
            kill -0 "${PIDS[$name]}" 2>/dev/null || fail "$name exited while waiting for $4"
        done
        [ "$SECONDS" -lt "$deadline" ] || fail "timed out after ${START_TIMEOUT} s waiting for $4"
        sleep 0.5
    done
}

# 1. certificates: a CA and the SuperLink's certificate (localhost, 127.0.0.1, ::1)
python make_certs.py --out "$CERTS"

# 2. the SuperLink, with TLS
flower-superlink --ssl-ca-certfile "$CERTS/ca.crt" --ssl-certfile "$CERTS/server.pem" \
    --ssl-keyfile "$CERTS/server.key" --port "$PORT" \
    --disable-runtime-dependency-installation > "$LOGS/superlink.log" 2>&1 &
PIDS[superlink]=$!
wait_for "$LOGS/superlink.log" "Uvicorn running" 1 "the SuperLink"

# 3. the SuperNodes: node k holds partition k and trusts the CA; beside each, a warm worker
#    runs all its ClientApp messages in one process (--isolation process: no process per message)
for k in $(seq 0 $((NODES - 1))); do
    flower-supernode --isolation process --superlink "127.0.0.1:$PORT" \
        --root-certificates "$CERTS/ca.crt" --port $((NODE_PORT + k)) \
        --node-config "partition-id=$k num-partitions=$NODES" > "$LOGS/node-$k.log" 2>&1 &
    PIDS[node-$k]=$!
    python -m fedppl.runtime.flower_worker --runtime-api-address "127.0.0.1:$((NODE_PORT + k))" \
        > "$LOGS/worker-$k.log" 2>&1 &
    PIDS[worker-$k]=$!
done
wait_for "$LOGS/superlink.log" "Activated node_id" "$NODES" "$NODES SuperNodes to connect"

# 4. flwr's connection to the SuperLink: its address and the CA to check its certificate by
cat > "$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "local-tls"

[superlink.local-tls]
address = "127.0.0.1:$PORT"
root-certificates = "$CERTS/ca.crt"
EOF

# 5. the run, in the background (so that a signal to this script stops it at once), its log
#    shown here as it comes
flwr run . local-tls --stream \
    --run-config "num-clients=$NODES num-rounds=$ROUNDS result-dir=\"$OUT\"" \
    > "$LOGS/run.log" 2>&1 &
PIDS[flwr-run]=$!
tail -n +1 -f --pid="${PIDS[flwr-run]}" "$LOGS/run.log" &
PIDS[tail]=$!
( sleep "$RUN_TIMEOUT"; kill -USR1 $$ ) &
PIDS[watchdog]=$!
trap 'fail "the run went on past ${RUN_TIMEOUT} s"' USR1
while kill -0 "${PIDS[flwr-run]}" 2>/dev/null; do  # a process that dies fails the run at once
    for name in "${!PIDS[@]}"; do
        kill -0 "${PIDS[$name]}" 2>/dev/null || [ "$name" = flwr-run ] || [ "$name" = tail ] \
            || fail "$name exited during the run"
    done
    sleep 1
done
wait "${PIDS[flwr-run]}" || fail "flwr run failed"
wait "${PIDS[tail]}" || true

# 6. how the run ended, as the SuperLink records it
RUN_ID=$(sed -n 's/.*Successfully started run \([0-9][0-9]*\).*/\1/p' "$LOGS/run.log" | head -n 1)
[ -n "$RUN_ID" ] || fail "flwr run printed no run id"
flwr ls local-tls --run-id "$RUN_ID" --format json > "$LOGS/status.json"
STATUS=$(python -c 'import json, sys; print(json.load(sys.stdin)["runs"][0]["status"])' \
    < "$LOGS/status.json") || fail "no status for run $RUN_ID: $(cat "$LOGS/status.json")"
[ "$STATUS" = "finished:completed" ] || fail "run $RUN_ID ended as $STATUS"
[ -f "$OUT/result.json" ] || fail "run $RUN_ID completed but wrote no $OUT/result.json"
echo "run_localhost: run $RUN_ID $STATUS; the posterior is in"
echo "$OUT/result.json"
