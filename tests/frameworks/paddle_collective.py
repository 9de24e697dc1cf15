#!/usr/bin/env python3
"""PaddlePaddle collective (gloo, CPU) data-parallel training on synthetic linear-regression data,
under tidepool's notice contract.

Kubeflow's PaddleJob (training-operator v1.9.3, collective mode: Worker replicas only) gives each
pod PADDLE_MASTER (worker 0: its own IP, the others <job>-worker-0, port 36543 unless the
container names another `master` port), PADDLE_NNODES and PADDLE_JOB_ID, and expects
`python -m paddle.distributed.launch` to rendezvous and start the trainer. Run as the container's
command (`python3 /opt/tidepool/paddle_collective.py`), this does that: it starts the launcher on
itself with Paddle's site on PYTHONPATH under tidepool_notice.supervise (SIGTERM passed on; when
a trainer wrote the ack, the ack exit code, not the launcher's 15 after a SIGTERM, which
Kubeflow's ExitCode policy takes for a permanent failure). Under the launcher (PADDLE_TRAINER_ID set) it
trains: every step the ranks all-reduce a stop flag; on the notice or SIGTERM rank 0 saves to
TP_STORE (key paddle-collective), the ranks told ack and exit, the others exit
TP_PEER_EXIT_CODE. Without PADDLE_MASTER it trains alone. Logs `rank R: step=N loss=X`.

Settings as torch_ddp.py: TP_DIM, TP_BATCH, TP_LR, TP_STEPS, TP_STEP_DELAY_MS, TP_LOG_EVERY,
TP_CHECKPOINT_EVERY, TP_SEED; TP_PADDLE_LOG_DIR (/tmp/paddle-log) for the launcher's logs.
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PIP = os.path.join(HERE, "pip")  # TensorFlow's and Paddle's site (numpy 2), off the default path
sys.path[:0] = [HERE, PIP]
import tidepool_notice as tp  # noqa: E402

KEY = "paddle-collective"


def launch() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [PIP, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "paddle.distributed.launch",
           "--log_dir", os.environ.get("TP_PADDLE_LOG_DIR", "/tmp/paddle-log"), os.path.abspath(__file__)]
    tp.supervise(cmd, env)


def main() -> None:
    if os.environ.get("PADDLE_MASTER") and "PADDLE_TRAINER_ID" not in os.environ:
        launch()
        return
    notice = tp.Notice()
    import paddle
    import paddle.distributed as dist

    notice.arm()  # importing paddle replaced the SIGTERM handler with one that only dies
    paddle.set_device("cpu")
    dim, batch, lr = tp.env_int("TP_DIM", 16), tp.env_int("TP_BATCH", 32), tp.env_float("TP_LR", 0.05)
    steps, log_every = tp.env_int("TP_STEPS", 0), max(1, tp.env_int("TP_LOG_EVERY", 10))
    every, seed = tp.env_int("TP_CHECKPOINT_EVERY", 0), tp.env_int("TP_SEED", 1)
    delay = tp.env_int("TP_STEP_DELAY_MS", 100) / 1000
    store = tp.Store.from_env()
    distributed = "PADDLE_TRAINER_ID" in os.environ and tp.env_int("PADDLE_TRAINERS_NUM", 1) > 1
    if distributed:
        dist.init_parallel_env()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    import numpy as np
    truth = np.random.default_rng(seed)
    w_true, b_true = truth.standard_normal((dim, 1)).astype("float32"), np.float32(truth.standard_normal())
    paddle.seed(seed)
    model = paddle.nn.Linear(dim, 1)
    step = 0
    if rank == 0:
        saved = tp.load(store, KEY)
        if saved is not None:
            step, _, arrays = saved
            model.set_state_dict({k: paddle.to_tensor(v) for k, v in arrays.items()})
    if distributed:
        t = paddle.to_tensor([step], dtype="int64")
        dist.broadcast(t, src=0)
        step = int(t.item())
        model = paddle.DataParallel(model)  # syncs rank 0's parameters
    tp.log(f"rank {rank}: {'resumed at step ' + str(step) if step else 'fresh'} (world {world})")
    opt = paddle.optimizer.SGD(learning_rate=lr, parameters=model.parameters())
    layers = model._layers if distributed else model

    def checkpoint() -> None:
        if rank == 0:
            tp.save(store, KEY, step, step * batch, {k: v.numpy() for k, v in layers.state_dict().items()})

    while True:
        why = notice.reason()
        flag = paddle.to_tensor([1 if why else 0], dtype="int32")
        if distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            tp.log(f"rank {rank}: {why or 'a peer got the notice'}: stopping at step {step}")
            checkpoint()
            if distributed:
                dist.barrier()  # nobody leaves before the save
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
        x = rng.standard_normal((batch, dim)).astype("float32")
        y = x @ w_true + b_true + 0.01 * rng.standard_normal((batch, 1)).astype("float32")
        loss = paddle.nn.functional.mse_loss(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()  # DataParallel all-reduces the gradients
        opt.step()
        opt.clear_grad()
        step += 1
        if step == 1 or step % log_every == 0:
            tp.log(f"rank {rank}: step={step} loss={float(loss):.6f}")
        if every and step % every == 0:
            checkpoint()
        time.sleep(delay)


if __name__ == "__main__":
    main()
