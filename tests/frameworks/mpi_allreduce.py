#!/usr/bin/env python3
"""Data-parallel SGD with mpi4py all-reduce on synthetic linear-regression data, under tidepool's
notice contract; for MPIJob v2 (the launcher runs `mpirun ... python3 /opt/tidepool/
mpi_allreduce.py`, which starts the ranks in the worker pods over ssh; the workers run
/opt/tidepool/sshd.sh).

Each rank computes the gradient on its own samples, the ranks average it with Allreduce and
apply it to their copy of the weights (all equal). Every step they also agree (an all-reduce
of a flag) whether any rank got the notice (its worker pod's /etc/tidepool/annotations), SIGTERM
(mpirun forwards it) or the stop file sshd.sh writes when its pod gets SIGTERM; then rank 0
saves to TP_STORE (key mpi-allreduce), the ranks told ack (in their worker pod's termination
message, which sshd.sh sees) and exit TP_ACK_EXIT_CODE, the others exit TP_PEER_EXIT_CODE.
Logs `rank R: step=N loss=X`. Settings as torch_ddp.py.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tidepool_notice as tp  # noqa: E402

KEY = "mpi-allreduce"


def main() -> None:
    notice = tp.Notice()
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    dim, batch, lr = tp.env_int("TP_DIM", 16), tp.env_int("TP_BATCH", 32), tp.env_float("TP_LR", 0.05)
    steps, log_every = tp.env_int("TP_STEPS", 0), max(1, tp.env_int("TP_LOG_EVERY", 10))
    every, seed = tp.env_int("TP_CHECKPOINT_EVERY", 0), tp.env_int("TP_SEED", 1)
    delay = tp.env_int("TP_STEP_DELAY_MS", 100) / 1000
    store = tp.Store.from_env()

    truth = np.random.default_rng(seed)
    w_true, b_true = truth.standard_normal(dim), truth.standard_normal()
    params = np.zeros(dim + 1)  # weights, then the bias
    step = 0
    if rank == 0:
        saved = tp.load(store, KEY)
        if saved is not None:
            step, _, arrays = saved
            params = arrays["params"]
    step, params = comm.bcast((step, params), root=0)
    tp.log(f"rank {rank}: {'resumed at step ' + str(step) if step else 'fresh'} (world {world})")

    def checkpoint() -> None:
        if rank == 0:
            tp.save(store, KEY, step, step * batch, {"params": params})

    while True:
        why = notice.reason()
        if comm.allreduce(1 if why else 0, op=MPI.MAX):
            tp.log(f"rank {rank}: {why or 'a peer got the notice'}: stopping at step {step}")
            checkpoint()
            comm.Barrier()  # nobody leaves before the save
            why = why or notice.wait(3)  # told too, a moment after a peer?
            if why:
                tp.ack(step, step * batch)
                tp.exit_acked()
            tp.exit_for_peer("notice")
        if steps and step >= steps:
            checkpoint()
            tp.log(f"rank {rank}: done at step {step}")
            return
        rng = np.random.default_rng([seed, rank, step])
        x = rng.standard_normal((batch, dim))
        y = x @ w_true + b_true + 0.01 * rng.standard_normal(batch)
        err = x @ params[:dim] + params[dim] - y
        loss = float(np.mean(err ** 2))
        grad = np.append(2 * x.T @ err / batch, 2 * err.mean())
        total = np.empty_like(grad)
        comm.Allreduce(grad, total, op=MPI.SUM)
        params = params - lr * total / world
        step += 1
        if step == 1 or step % log_every == 0:
            tp.log(f"rank {rank}: step={step} loss={comm.allreduce(loss) / world:.6f}")
        if every and step % every == 0:
            checkpoint()
        time.sleep(delay)


if __name__ == "__main__":
    main()
