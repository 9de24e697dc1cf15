#!/usr/bin/env python3
"""TensorFlow ParameterServerStrategy training of a linear model on synthetic data, under
tidepool's notice contract.

TF_CONFIG (as Kubeflow's TFJob sets it: a cluster with `chief`, `ps` and `worker` tasks) decides
the role. `ps` and `worker` tasks run a tf.distribute.Server; the chief creates the variables on
the parameter servers and drives a custom loop (Keras 3 has no PS training) through
tf.distribute.coordinator.ClusterCoordinator, which runs the steps on the workers. Without
TF_CONFIG it trains in this one process (a quick local check).

On the notice or SIGTERM the chief reads the variables back from the parameter servers, saves
them with the step to TP_STORE (key tf-ps, then tf-ps.saved with the step and the time), acks
and exits with the ack exit code (tidepool_notice.ack_exit_code). A ps or worker task told to stop keeps serving until the chief's
save is newer than its notice (so the chief can still read the variables), at most
TP_DRAIN_SECONDS (20; 5 after a SIGTERM), then acks with the saved step and exits. Started
again the chief resumes from the saved step. Logs `chief: step=N loss=X`.

Settings as torch_ddp.py (TP_DIM, TP_BATCH, TP_LR, TP_STEPS, TP_STEP_DELAY_MS, TP_LOG_EVERY,
TP_CHECKPOINT_EVERY, TP_SEED) and TP_DRAIN_SECONDS.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "pip")]  # TensorFlow's site (numpy 2), off the default path
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tidepool_notice as tp  # noqa: E402

KEY = "tf-ps"


def exit_now(code: int) -> None:
    # A running tf.distribute.Server can hold the interpreter's exit: leave at once.
    sys.stdout.flush()
    os._exit(code)


def saved_step(store: tp.Store | None) -> tuple[int, float]:
    """The step and time of the chief's last save (0, 0 when none)."""
    try:
        body = store.get(KEY + ".saved") if store else None
    except OSError:
        body = None
    if not body:
        return 0, 0.0
    meta = json.loads(body)
    return int(meta["step"]), float(meta["time"])


def serve(task: str, index: int, cluster, rpc: str, notice: tp.Notice, store: tp.Store | None) -> None:
    import tensorflow as tf
    os.environ["GRPC_FAIL_FAST"] = "use_caller"
    tf.distribute.Server(cluster, job_name=task, task_index=index, protocol=rpc, start=True)
    tp.log(f"{task} {index}: serving")
    while not (why := notice.reason()):
        time.sleep(0.5)
    limit = tp.env_int("TP_DRAIN_SECONDS", 20)
    limit = min(limit, 5) if why.startswith("SIGTERM") else limit
    tp.log(f"{task} {index}: {why}: serving until the chief has saved (at most {limit} s)")
    end = time.time() + limit
    step, when = saved_step(store)
    while when < (notice.since or 0) - 1 and time.time() < end:
        time.sleep(0.5)
        step, when = saved_step(store)
    tp.log(f"{task} {index}: the chief's last save is at step {step}")
    tp.ack(step, 0)
    exit_now(tp.ack_exit_code())


def main() -> None:
    notice = tp.Notice()
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    dim, batch, lr = tp.env_int("TP_DIM", 16), tp.env_int("TP_BATCH", 32), tp.env_float("TP_LR", 0.05)
    steps, log_every = tp.env_int("TP_STEPS", 0), max(1, tp.env_int("TP_LOG_EVERY", 10))
    every, seed = tp.env_int("TP_CHECKPOINT_EVERY", 0), tp.env_int("TP_SEED", 1)
    delay = tp.env_int("TP_STEP_DELAY_MS", 100) / 1000
    store = tp.Store.from_env()

    coordinator = None
    if os.environ.get("TF_CONFIG"):
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        cluster = resolver.cluster_spec()
        if resolver.task_type in ("ps", "worker"):
            serve(resolver.task_type, resolver.task_id, cluster, resolver.rpc_layer or "grpc", notice, store)
        for address in cluster.job_tasks("ps") + cluster.job_tasks("worker"):
            host, _, port = address.rpartition(":")  # TFJob starts every pod at once
            if not tp.wait_for_port(host, int(port), notice):
                break
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    else:
        strategy = tf.distribute.get_strategy()

    truth = np.random.default_rng(seed)
    w_true = tf.constant(truth.standard_normal((dim, 1)), tf.float32)
    b_true = tf.constant(truth.standard_normal(), tf.float32)
    saved = tp.load(store, KEY)
    step = saved[0] if saved else 0
    with strategy.scope():
        w = tf.Variable(saved[2]["w"] if saved else tf.zeros([dim, 1]), name="w")
        b = tf.Variable(saved[2]["b"] if saved else tf.zeros([1]), name="b")
    tp.log(f"chief: {'resumed at step ' + str(step) if step else 'fresh'}"
           f" ({'parameter servers ' + ','.join(cluster.job_tasks('ps')) if coordinator else 'one process'})")

    @tf.function
    def train_step(k: tf.Tensor) -> tf.Tensor:
        s = tf.stack([tf.constant(seed, tf.int64), k])
        x = tf.random.stateless_normal([batch, dim], seed=s)
        y = x @ w_true + b_true + 0.01 * tf.random.stateless_normal([batch, 1], seed=s + 1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(x @ w + b - y))
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(lr * gw)
        b.assign_sub(lr * gb)
        return loss

    def checkpoint() -> None:
        tp.save(store, KEY, step, step * batch, {"w": w.numpy(), "b": b.numpy()})
        if store:
            store.put(KEY + ".saved", json.dumps({"step": step, "time": time.time()}).encode())

    while True:
        if why := notice.reason():
            tp.log(f"chief: {why}: saving at step {step}")
            checkpoint()
            tp.ack(step, step * batch)
            exit_now(tp.ack_exit_code())
        if steps and step >= steps:
            checkpoint()
            tp.log(f"chief: done at step {step}")
            exit_now(0)
        # A group of steps, run on the workers in parallel (asynchronous SGD), then one log line.
        group = [tf.constant(step + i, tf.int64) for i in range(log_every)]
        if coordinator:
            results = [coordinator.schedule(train_step, args=(k,)) for k in group]
            coordinator.join()
            loss = float(results[-1].fetch())
        else:
            loss = float([train_step(k) for k in group][-1])
        step += log_every
        tp.log(f"chief: step={step} loss={loss:.6f}")
        if every and step % every < log_every:
            checkpoint()
        time.sleep(delay * log_every)


if __name__ == "__main__":
    main()
