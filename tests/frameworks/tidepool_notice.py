"""Tidepool's reclaim-notice contract for the framework trainers (deploy/docs/tenants.md), as
tests/workload's tp-train keeps it:

- the notice is the line `tidepool.io/reclaim-deadline="<RFC 3339>"` in the downward-API file
  /etc/tidepool/annotations (TP_ANNOTATIONS); SIGTERM (the member's own preemption) and the
  stop file TP_STOP_FILE (written by sshd.sh when an MPI worker pod gets SIGTERM, and by supervise()
  when its pod does) count the same;
- on it the job saves a checkpoint to the S3 store TP_STORE (http://host:port/bucket[/prefix],
  plain PUT/GET, any Authorization header), writes `tidepool.io/checkpointed step=N offset=M`
  to /dev/termination-log (TP_TERMINATION_LOG) and exits with TP_ACK_EXIT_CODE, else the
  TIDEPOOL_ACK_EXIT_CODE tidepool sets in its copies (143 under restartPolicy Never: Kubeflow's
  ExitCode restart policy retries only codes >= 128), else 0, as tp-train;
- a process that stops because a *peer* got the notice acks nothing and exits with
  TP_PEER_EXIT_CODE (143): non-zero, so OnFailure and ExitCode policies and torchrun's agent
  restart it, and it resumes from the checkpoint with the others.

Checkpoints are numpy .npz files (`step`, `offset` and the model's arrays): every framework
here can turn its parameters into numpy arrays and back.
"""

from __future__ import annotations

import http.client
import io
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

RECLAIM_DEADLINE = "tidepool.io/reclaim-deadline"
ACK_PREFIX = "tidepool.io/checkpointed"
# Set by supervise() in its launcher's environment.
SUPERVISED = "TP_SUPERVISED"
# tests/workload/src/store.rs: moto checks no signature but refuses anonymous reads.
AUTH = ("AWS4-HMAC-SHA256 Credential=tidepool/20260101/us-east-1/s3/aws4_request, "
        "SignedHeaders=host, Signature=0")


def log(msg: str) -> None:
    print(msg, flush=True)


def env_int(key: str, default: int) -> int:
    value = os.environ.get(key, "")
    return int(value) if value else default


def env_float(key: str, default: float) -> float:
    value = os.environ.get(key, "")
    return float(value) if value else default


def stop_file() -> str:
    """The file whose existence counts as SIGTERM (TP_STOP_FILE)."""
    return os.environ.get("TP_STOP_FILE") or "/tmp/tidepool-stop"


def deadline(text: str) -> str | None:
    """The reclaim deadline in an annotations file's text (`key="value"` lines), if any."""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key == RECLAIM_DEADLINE:
            return value.strip('"')
    return None


class Notice:
    """Why this process must stop now, if it must. Create it first thing: the SIGTERM handler
    is installed in the constructor, so no early signal is lost."""

    def __init__(self) -> None:
        self.annotations = os.environ.get("TP_ANNOTATIONS") or "/etc/tidepool/annotations"
        self.stop_file = stop_file()
        self.sigterm = False
        self.since: float | None = None
        self.arm()

    def arm(self) -> None:
        """(Re)installs the SIGTERM handler: call again after importing a framework that installs
        its own (Paddle does, and would die on SIGTERM without saving)."""
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, *_: Any) -> None:
        self.sigterm = True

    def restart(self) -> bool:
        """Whether the only SIGTERM was the launcher's own (torchrun's agent restarting its
        workers to re-form the job), not the pod's: supervise() writes the stop file before it
        passes the pod's SIGTERM on. A restarted process is not told to stop: it acks nothing."""
        return self.sigterm and SUPERVISED in os.environ and not os.path.exists(self.stop_file) and not self._deadline()

    def _deadline(self) -> str | None:
        try:
            with open(self.annotations) as f:
                return deadline(f.read())
        except OSError:
            return None

    def reason(self) -> str | None:
        why = None
        if self.sigterm:
            why = "SIGTERM"
        elif os.path.exists(self.stop_file):
            why = "SIGTERM (stop file)"
        elif (d := self._deadline()) is not None:
            why = f"reclaim notice (deadline {d})"
        if why and self.since is None:
            self.since = time.time()
        return why

    def wait(self, seconds: float) -> str | None:
        """The notice if it comes within `seconds`. A process stopped by a peer's notice waits
        a moment for its own: the SIGTERMs of a whole job arrive together, but not at once
        (Paddle's launcher stops its rendezvous server before it signals its trainer)."""
        end = time.time() + seconds
        while not (why := self.reason()) and time.time() < end:
            time.sleep(0.1)
        return why


class Store:
    """The S3-compatible checkpoint store, spoken to with plain HTTP/1.1 PUT and GET."""

    def __init__(self, url: str) -> None:
        if not url.startswith("http://"):
            raise ValueError(f"{url!r}: only http:// URLs")
        authority, _, path = url[len("http://"):].partition("/")
        host, _, port = authority.rpartition(":") if ":" in authority else (authority, "", "80")
        self.host, self.port = host, int(port)
        self.bucket, _, self.prefix = path.strip("/").partition("/")
        if not self.host or not self.bucket:
            raise ValueError(f"{url!r}: want http://host:port/bucket[/prefix]")
        self._bucket_made = False

    @staticmethod
    def from_env() -> Store | None:
        url = os.environ.get("TP_STORE", "")
        return Store(url) if url else None

    def path(self, key: str) -> str:
        return f"/{self.bucket}/{self.prefix}/{key}" if self.prefix else f"/{self.bucket}/{key}"

    def _request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        # Bounded connects, a few tries: an unanswered SYN must not hold a save for minutes.
        last: Exception | None = None
        for _ in range(6):
            conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
            try:
                conn.request(method, path, body=body, headers={
                    "Authorization": AUTH, "Content-Type": "application/octet-stream"})
                reply = conn.getresponse()
                return reply.status, reply.read()
            except (OSError, http.client.HTTPException) as e:
                last = e
                time.sleep(1)
            finally:
                conn.close()
        raise OSError(f"{method} {self.host}:{self.port}{path}: {last}")

    def put(self, key: str, body: bytes) -> None:
        if not self._bucket_made:
            status, reply = self._request("PUT", f"/{self.bucket}")
            if status not in (200, 409):
                raise OSError(f"create bucket {self.bucket}: HTTP {status}: {reply[:200]!r}")
            self._bucket_made = True
        status, reply = self._request("PUT", self.path(key), body)
        if status != 200:
            raise OSError(f"PUT {key}: HTTP {status}: {reply[:200]!r}")

    def get(self, key: str) -> bytes | None:
        status, body = self._request("GET", self.path(key))
        if status == 404:
            return None
        if status != 200:
            raise OSError(f"GET {key}: HTTP {status}: {body[:200]!r}")
        return body


def save(store: Store | None, key: str, step: int, offset: int, arrays: dict[str, Any]) -> None:
    """Stores a checkpoint: step, offset and named numpy arrays."""
    import numpy as np
    if store is None:
        log("no TP_STORE: nothing to save")
        return
    buf = io.BytesIO()
    np.savez(buf, step=np.int64(step), offset=np.int64(offset), **arrays)
    store.put(key, buf.getvalue())
    log(f"checkpoint saved: {key} step={step} offset={offset}")


def load(store: Store | None, key: str) -> tuple[int, int, dict[str, Any]] | None:
    """The checkpoint under `key` (step, offset, arrays), or None on a first start."""
    import numpy as np
    if store is None:
        return None
    body = store.get(key)
    if body is None:
        return None
    with np.load(io.BytesIO(body)) as z:
        arrays = {k: z[k] for k in z.files if k not in ("step", "offset")}
        return int(z["step"]), int(z["offset"]), arrays


def ack(step: int, offset: int) -> None:
    """Writes the ack to the termination message: the member's kubelet reports it."""
    line = f"{ACK_PREFIX} step={step} offset={offset}\n"
    path = os.environ.get("TP_TERMINATION_LOG") or "/dev/termination-log"
    try:
        with open(path, "w") as f:
            f.write(line)
        log(f"ack: {line.strip()}")
    except OSError as e:
        log(f"ack not written to {path}: {e}")


def ack_exit_code() -> int:
    """TP_ACK_EXIT_CODE when set; else what tidepool tells its copies in TIDEPOOL_ACK_EXIT_CODE
    (143 under restartPolicy Never, which Kubeflow's ExitCode policy retries; 0 otherwise);
    else 0, as tp-train."""
    return env_int("TP_ACK_EXIT_CODE", env_int("TIDEPOOL_ACK_EXIT_CODE", 0))


def exit_acked() -> None:
    sys.exit(ack_exit_code())


def exit_for_peer(why: str) -> None:
    log(f"a peer stopped ({why}): exiting to be restarted")
    sys.exit(env_int("TP_PEER_EXIT_CODE", 143))


def acked() -> bool:
    """Whether this container's termination message holds an ack already."""
    try:
        with open(os.environ.get("TP_TERMINATION_LOG") or "/dev/termination-log") as f:
            return f.read().startswith(ACK_PREFIX)
    except OSError:
        return False


def supervise(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """Runs a launcher (torchrun, Paddle's launcher) as a child and exits as the pod should.
    SIGTERM is passed on. Once a trainer under it wrote the ack to this container's
    termination message, the launcher gets ACK_LINGER seconds to end, then SIGTERM, then after
    as long again SIGKILL: torchrun's agent would otherwise wait up to 300 s at its exit barrier
    for the agents that go on (deaf to SIGTERM there), and the kubelet reports the ack only when
    the container exits. The exit code is then the ack
    exit code, not the launcher's (torchrun exits 1 and Paddle's launcher 15 after a SIGTERM,
    which Kubeflow's ExitCode policy takes for permanent failures)."""
    env = dict(env if env is not None else os.environ, **{SUPERVISED: "1"})
    proc = subprocess.Popen(cmd, env=env)
    def on_sigterm(*_: Any) -> None:
        # The pod's SIGTERM: said in the stop file first, so the trainers under the launcher
        # tell it from the launcher's own SIGTERM when it restarts them (Notice.restart).
        with open(stop_file(), "a"):
            pass
        proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    acked_at: float | None = None
    sent = 0  # signals sent after the ack: SIGTERM, then SIGKILL
    while True:
        try:
            code = proc.wait(timeout=1)
            break
        except subprocess.TimeoutExpired:
            pass
        if acked_at is None:
            acked_at = time.time() if acked() else None
            continue
        waited = time.time() - acked_at
        if sent == 0 and waited > ACK_LINGER:
            log(f"the ack is written: stopping {cmd[0]}")
            proc.send_signal(signal.SIGTERM)
            sent = 1
        elif sent == 1 and waited > 2 * ACK_LINGER:
            # torchrun's agent blocks in its exit barrier, where SIGTERM is not handled; its
            # workers are gone.
            log(f"{cmd[0]} did not stop: killing it")
            proc.kill()
            sent = 2
    if acked():
        exit_acked()
    sys.exit(code)


ACK_LINGER = 5


def wait_for_port(host: str, port: int, notice: Notice, limit: float = 600) -> bool:
    """Waits until host:port accepts a connection (a peer that is not up yet, a name that does
    not resolve yet); False if the notice came first or `limit` passed."""
    end = time.time() + limit
    while time.time() < end and not notice.reason():
        try:
            socket.create_connection((host, port), timeout=2).close()
            return True
        except OSError:
            time.sleep(1)
    return False


if __name__ == "__main__":
    # `python3 tidepool_notice.py LAUNCHER ARGS...`: supervise() a launcher, e.g.
    # `python3 /opt/tidepool/tidepool_notice.py torchrun --nnodes=1:3 ... /opt/tidepool/torch_ddp.py`.
    if len(sys.argv) < 2:
        sys.exit("usage: tidepool_notice.py LAUNCHER [ARGS...]")
    supervise(sys.argv[1:])
