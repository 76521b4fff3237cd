#!/usr/bin/env bash
# Entrypoint of the trainyard image. The first argument picks the role:
#
#   serve [ARGS]         the API: trainyard serve ARGS (the default when no argument is given)
#   worker [ARGS]        one worker: trainyard worker ARGS, e.g. `worker --device cpu`
#   gpu-workers [ARGS]   one worker per GPU the container sees, listed with NVML (each MIG instance
#                        of a card in MIG mode is one), each given ARGS, its own
#                        CUDA_VISIBLE_DEVICES=<that GPU's UUID> and `--device cuda:0`: CUDA reaches a MIG
#                        instance through that variable only, and a job sees no other GPU than its
#                        worker's. A CUDA_VISIBLE_DEVICES already set narrows the list. Or one worker
#                        per entry of TRAINYARD_WORKER_DEVICES, e.g. "cuda:0 cuda:2" or "cpu cpu", each
#                        seeing what the container sees
#   up [ARGS]            API and workers in one container: trainyard up ARGS
#   anything else        handed to trainyard as is: `jobs`, `devices --json`, `--help`, ...
#                        (for a shell instead: docker run --entrypoint sh ...)
#
# Every role but gpu-workers with several devices ends in `exec trainyard ...`: trainyard then has
# this script's pid (PID 1, or tini's child under compose's `init: true`), so the SIGTERM of
# `docker stop` reaches it directly. That matters: a worker checkpoints its job and requeues it on
# SIGTERM, within TRAINYARD_GRACE_S. With several workers this script stays as their parent,
# forwards SIGTERM/SIGINT to each, and exits when all have.
#
# All TRAINYARD_* variables reach trainyard unchanged. These are read here only:
#   TRAINYARD_URL             when set, the worker roles first wait until $TRAINYARD_URL/healthz
#                             answers, so the API has created the database schema
#   TRAINYARD_WAIT_S          how long to wait for that (default 120); then exit 1 (and compose's
#                             restart policy tries again)
#   TRAINYARD_WORKER_PIDFILE  where the worker roles write their pids for healthcheck.py
#                             (default /tmp/trainyard-workers.pid)
#   TRAINYARD_NVML_READINGS   gpu-workers lists the GPUs of this file of recorded NVML readings
#                             instead of the host's (python -m trainyard.app.fleet.gpu_order --help): for
#                             tests, and a dry run of the role on a machine without GPUs
# And one is set here for the worker roles: TRAINYARD_WORKER_STATUS_DIR (default
# /tmp/trainyard-workers.status), where each worker writes its state at every heartbeat for
# healthcheck.py (emptied at start: a file from an earlier run must not speak for a new worker).
# Bash rather than sh for `wait -n -p` (bash >= 5.1) in the multi-worker supervisor.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
pidfile=${TRAINYARD_WORKER_PIDFILE:-/tmp/trainyard-workers.pid}
status_dir=${TRAINYARD_WORKER_STATUS_DIR:-/tmp/trainyard-workers.status}
role=${1:-serve}
[ $# -gt 0 ] && shift

log() { echo "entrypoint: $*" >&2; }

wait_for_api() {
    [ -n "${TRAINYARD_URL:-}" ] || return 0
    log "waiting up to ${TRAINYARD_WAIT_S:-120}s for the API at $TRAINYARD_URL"
    python "$here/healthcheck.py" api --url "$TRAINYARD_URL" --wait "${TRAINYARD_WAIT_S:-120}"
}

worker_status() {  # a fresh status directory for this run's workers
    export TRAINYARD_WORKER_STATUS_DIR=$status_dir
    mkdir -p "$status_dir"
    rm -f "$status_dir"/*.json
}

# One worker per device: the array `devices`, and `visible` (when not empty) each one's CUDA_VISIBLE_DEVICES.
worker_command() {  # worker_command I: the command that starts worker I, in the array `cmd`
    cmd=(trainyard worker --device "${devices[$1]}")
    if [ "${#visible[@]}" -gt 0 ]; then cmd=(env "CUDA_VISIBLE_DEVICES=${visible[$1]}" "${cmd[@]}"); fi
}

# Start one worker per device, forward stop signals, exit when all have exited. A worker that
# fails (non-zero) stops the others, so the container exits and its restart policy starts a
# fresh set (the stopped workers' jobs are checkpointed and requeued, no attempt used up).
supervise() {  # supervise ARGS... ; devices in the arrays `devices` and `visible`
    local pids=() i left status=0 rc done_pid stopping=0 cmd
    # shellcheck disable=SC2317  # invoked by the trap
    stop() { stopping=1; [ ${#pids[@]} -eq 0 ] || kill -TERM "${pids[@]}" 2>/dev/null || true; }
    trap stop TERM INT   # before the first worker starts, so none can be left behind
    for i in "${!devices[@]}"; do
        worker_command "$i"
        "${cmd[@]}" "$@" &   # env execs trainyard: $! is the worker's own pid
        pids+=("$!")
    done
    if [ "$stopping" = 1 ]; then stop; fi   # a signal came while they were starting
    echo "${pids[*]}" >"$pidfile"
    log "workers on ${visible[*]:-${devices[*]}} (pids ${pids[*]})"
    left=${#pids[@]}
    while [ "$left" -gt 0 ]; do
        done_pid=
        if wait -n -p done_pid; then rc=0; else rc=$?; fi
        if [ -z "${done_pid:-}" ]; then   # no pid: a trapped signal interrupted `wait`
            [ "$rc" = 127 ] && break       # (or no child is left, which `left` should rule out)
            continue
        fi
        left=$((left - 1))
        if [ "$rc" != 0 ] && [ "$status" = 0 ]; then
            status=$rc
            [ "$stopping" = 1 ] || { log "worker $done_pid exited with status $rc; stopping the others"; stop; }
        fi
    done
    exit "$status"
}

case "$role" in
    serve | up)
        rm -f "$pidfile"   # a stale one would make the auto health check look at workers
        exec trainyard "$role" "$@"
        ;;
    worker)
        wait_for_api
        worker_status
        echo "$$" >"$pidfile"   # exec keeps the pid: this is trainyard's own
        exec trainyard worker "$@"
        ;;
    gpu-workers)
        wait_for_api
        worker_status
        visible=()
        if [ -n "${TRAINYARD_WORKER_DEVICES:-}" ]; then
            read -r -a devices <<<"$TRAINYARD_WORKER_DEVICES"
        else
            # NVML, not torch: listing must not create a CUDA context (app/fleet/gpu_order.py).
            uuids=$(python -m trainyard.app.fleet.gpu_order ${TRAINYARD_NVML_READINGS:+--readings "$TRAINYARD_NVML_READINGS"})
            read -r -a visible <<<"$uuids"
            devices=()
            for _ in "${visible[@]}"; do devices+=("cuda:0"); done
        fi
        if [ "${#devices[@]}" -eq 0 ]; then
            log "no GPU visible in this container: is the NVIDIA Container Toolkit installed on the host?" \
                "Without a GPU, use the CPU variant (docker-compose.cpu.yml) or set TRAINYARD_WORKER_DEVICES=cpu"
            exit 1
        fi
        if [ "${#devices[@]}" -eq 1 ]; then
            echo "$$" >"$pidfile"
            worker_command 0
            exec "${cmd[@]}" "$@"
        fi
        supervise "$@"
        ;;
    *)
        exec trainyard "$role" "$@"
        ;;
esac
