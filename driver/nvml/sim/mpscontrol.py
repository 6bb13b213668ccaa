"""The simulator's ``nvidia-cuda-mps-control`` stand-in, written into the fake driver root.

It speaks the control protocol NVIDIA documents for the real program, so the plugin code that
drives it (``kubeletplugin.mps``) is the code that drives the real daemon on hardware:

- ``nvidia-cuda-mps-control -d`` starts the control daemon in the background and returns. The
  daemon makes ``$CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``), writes its PID to
  ``nvidia-cuda-mps-control.pid`` there and logs to ``control.log`` in
  ``$CUDA_MPS_LOG_DIRECTORY`` (default ``/var/log/nvidia-mps``), as the real one does.
- ``nvidia-cuda-mps-control -f`` runs the same daemon in the foreground: the process started is
  the daemon (its PID is the one its parent got from fork), it also logs to standard error, and
  SIGTERM or SIGINT make it exit as ``quit`` does. This is how carve runs it (the PID comes
  from fork, never from the pid file), and how a container runs it as its main process.
- ``nvidia-cuda-mps-control`` without options is the client: it reads commands from standard
  input, one a line, hands each to the daemon of ``$CUDA_MPS_PIPE_DIRECTORY`` and prints the
  reply. Simulated commands: ``get_server_list`` (no MPS server ever runs here, so the list is
  empty), ``set_default_active_thread_percentage P`` / ``get_default_active_thread_percentage``,
  ``set_default_device_pinned_mem_limit DEV VALUE`` / ``get_default_device_pinned_mem_limit
  DEV``, ``quit``. Others are answered with an error line and logged.

How the stand-in's client and daemon talk is its own business (the real ones use a private
protocol over the same directory): a FIFO ``control`` in the pipe directory takes one request
line per command, naming a reply FIFO the client made next to it by *file name only*, so a
client in a container that has the directory mounted elsewhere is answered too. Both ends open
FIFOs read-write, which never blocks, so a client that dies cannot wedge the daemon.

The daemon keeps its settings in files in the pipe directory (``default_active_thread_
percentage``, ``pinned_mem_limit.<dev>``) and writes every command it receives to
``control.log`` with the word ``CMD``; tests read both. POSIX sh only (busybox is enough).
"""

from __future__ import annotations

MPS_CONTROL = "usr/bin/nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_FIFO = "control"
CONTROL_LOG = "control.log"
END = "@@carve-mps-end@@"

SCRIPT = r"""#!/bin/sh
# @@MARKER@@: nvidia-cuda-mps-control stand-in.
#
# Written by carve's NVML simulator (driver/nvml/sim/mpscontrol.py). `-d` starts the control
# daemon in the background, `-f` in the foreground; without options this is the client:
# commands on standard input, replies on standard output. POSIX sh only.

PIPE=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
LOGDIR=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
END='@@END@@'

FOREGROUND=
log() {
    line="[$(date '+%Y-%m-%d %H:%M:%S')] $*"
    printf '%s\n' "$line" >>"$LOGDIR/control.log"
    if [ -n "$FOREGROUND" ]; then printf '%s\n' "$line" >&2; fi
}

answer() {
    # answer COMMAND ARGS...: print the reply of one command (runs in the daemon)
    case $1 in
    get_server_list) ;;
    get_default_active_thread_percentage)
        if [ -f "$PIPE/default_active_thread_percentage" ]; then
            cat "$PIPE/default_active_thread_percentage"
        else
            echo 100.0
        fi
        ;;
    set_default_active_thread_percentage)
        case ${2-} in
        '' | *[!0-9.]*) echo "Invalid percentage ${2-}" ;;
        *)
            printf '%s.0\n' "${2%%.*}" >"$PIPE/default_active_thread_percentage"
            cat "$PIPE/default_active_thread_percentage"
            ;;
        esac
        ;;
    set_default_device_pinned_mem_limit)
        case ${2-}:${3-} in
        [0-9]*:[0-9]*[MG]) echo "$3" >"$PIPE/pinned_mem_limit.$2" ;;
        *) echo "Invalid device pinned memory limit: ${2-} ${3-}" ;;
        esac
        ;;
    get_default_device_pinned_mem_limit)
        if [ -f "$PIPE/pinned_mem_limit.${2-x}" ]; then
            cat "$PIPE/pinned_mem_limit.$2"
        else
            echo 0
        fi
        ;;
    quit) ;;
    *) echo "Unknown command: $*" ;;
    esac
}

daemon_loop() {
    # fd 3 is the control FIFO, opened by start_daemon before this process was started
    log "Starting control daemon, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-}"
    while read -r reply cmd <&3; do
        log "CMD $cmd"
        case $reply in */* | '' | .*) continue ;; esac
        [ -p "$PIPE/$reply" ] || continue
        # shellcheck disable=SC2086
        { answer $cmd; echo "$END"; } 1<>"$PIPE/$reply"
        case $cmd in quit | 'quit '*) break ;; esac
    done
    stop_daemon
}

stop_daemon() {
    log "Control daemon exiting"
    rm -f "$PIPE/nvidia-cuda-mps-control.pid" "$PIPE/control"
    exit 0
}

running() {
    # running PID: alive and not a zombie waiting to be reaped
    kill -0 "$1" 2>/dev/null || return 1
    [ -r "/proc/$1/stat" ] || return 0
    case $(sed 's/.*) //' "/proc/$1/stat") in Z* | X*) return 1 ;; esac
    return 0
}

start_daemon() {
    mkdir -p "$PIPE" "$LOGDIR" || exit 1
    # Its own PID is not another instance: in a container of its own the daemon is PID 1 again
    # after one that was killed left its pid file behind.
    other=$(cat "$PIPE/nvidia-cuda-mps-control.pid" 2>/dev/null)
    if [ -n "$other" ] && [ "$other" != "$$" ] && running "$other"; then
        echo "An instance of this daemon is already running" >&2
        exit 1
    fi
    # Held open from before `-d` returns: a FIFO that nobody holds drops what is written to
    # it, so a client quick enough to write before the daemon had opened it would wait for a
    # reply forever. The daemon inherits this descriptor. Made under a name of its own and
    # renamed over a stale one: a client that found the stale FIFO and opens `control` just
    # after it was removed would make a plain file of that name (`1<>` creates).
    mkfifo -m 600 "$PIPE/control.$$" || exit 1
    exec 3<>"$PIPE/control.$$"
    mv -f "$PIPE/control.$$" "$PIPE/control" || exit 1
    if [ "$1" = foreground ]; then
        FOREGROUND=1
        echo $$ >"$PIPE/nvidia-cuda-mps-control.pid"
        exec </dev/null
        trap stop_daemon TERM INT
        daemon_loop
    fi
    # exec, not a redirection of the call: dash keeps copies of redirected descriptors, and a
    # copy of the caller's stdout would keep whoever started `-d` waiting for end of file.
    (
        exec </dev/null >/dev/null 2>&1
        daemon_loop
    ) &
    echo $! >"$PIPE/nvidia-cuda-mps-control.pid"
    exit 0
}

client() {
    if [ ! -p "$PIPE/control" ]; then
        echo "Cannot find MPS control daemon process" >&2
        exit 1
    fi
    reply=reply.$$.$(hostname 2>/dev/null || echo x)
    rm -f "$PIPE/$reply"
    mkfifo -m 600 "$PIPE/$reply" || exit 1
    exec 4<>"$PIPE/$reply"
    status=0
    while read -r line; do
        [ -n "$line" ] || continue
        printf '%s %s\n' "$reply" "$line" 1<>"$PIPE/control"
        while read -r out <&4; do
            [ "$out" = "$END" ] && break
            echo "$out"
            case $out in Invalid* | Unknown*) status=1 ;; esac
        done
        case $line in quit | 'quit '*) break ;; esac
    done
    exec 4<&-
    rm -f "$PIPE/$reply"
    exit $status
}

case ${1-} in
-d) start_daemon background ;;
-f) start_daemon foreground ;;
'') client ;;
*)
    echo "Usage: nvidia-cuda-mps-control [-d | -f]" >&2
    exit 2
    ;;
esac
"""


def mps_control_script(marker: str) -> str:
    """The stand-in's text (it carries the simulator's marker, like every file it writes)."""
    return SCRIPT.replace("@@MARKER@@", marker).replace("@@END@@", END)
