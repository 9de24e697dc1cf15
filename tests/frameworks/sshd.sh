#!/bin/bash
# An MPIJob v2 worker's command: sshd in the foreground (mpirun in the launcher reaches the
# worker through it), with tidepool's notice contract for the pod as a whole.
#   - Host keys are made at start (none are baked into the image), /run/sshd exists.
#   - The ranks mpirun starts here see the pod's /etc/tidepool/annotations themselves and write
#     the ack to the pod's termination message; once a line `tidepool.io/checkpointed ...` is
#     there, sshd is stopped and this exits TP_ACK_EXIT_CODE, else TIDEPOOL_ACK_EXIT_CODE (set
#     by tidepool in its copies), else 0: the pod ends after the ack.
#   - SIGTERM (the member preempting the pod) reaches only this process: it writes the stop
#     file (TP_STOP_FILE, /tmp/tidepool-stop) the ranks treat as SIGTERM, waits for their ack
#     at most TP_DRAIN_SECONDS (20), then stops sshd and exits 143 without one.
# Arguments are passed to sshd (e.g. -p PORT).
set -euo pipefail

stop_file=${TP_STOP_FILE:-/tmp/tidepool-stop}
termlog=${TP_TERMINATION_LOG:-/dev/termination-log}
drain=${TP_DRAIN_SECONDS:-20}
rm -f "$stop_file"
/usr/bin/ssh-keygen -A >/dev/null   # the image's own, by path: this runs in a pod, not on the host
mkdir -p /run/sshd
/usr/sbin/sshd -De "$@" &
sshd=$!
stopping=-1   # SECONDS at the SIGTERM
# On SIGTERM: tell the ranks, start the drain clock.
trap 'echo "sshd.sh: SIGTERM: telling the ranks to checkpoint"; : >"$stop_file"; stopping=$SECONDS' TERM

acked() { grep -q '^tidepool.io/checkpointed' "$termlog" 2>/dev/null; }
while kill -0 "$sshd" 2>/dev/null; do
  if acked; then
    echo "sshd.sh: the ranks acked: $(head -n 1 "$termlog")"
    kill "$sshd"; wait "$sshd" || true
    exit "${TP_ACK_EXIT_CODE:-${TIDEPOOL_ACK_EXIT_CODE:-0}}"
  fi
  if ((stopping >= 0 && SECONDS - stopping >= drain)); then
    echo "sshd.sh: no ack within $drain s of SIGTERM"
    kill "$sshd"; wait "$sshd" || true
    exit 143
  fi
  # sleep in the background and wait for it: bash runs the TERM trap at once, not after sleep.
  sleep 1 &
  wait $! || true
done
wait "$sshd"
