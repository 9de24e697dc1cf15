#!/usr/bin/env python3
"""PyTorch DDP over gloo on synthetic linear-regression data, under tidepool's notice contract.

Started by Kubeflow's PyTorchJob (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK in the env) or by
torchrun, elastic too, under tidepool_notice.py (`python3 /opt/tidepool/tidepool_notice.py
torchrun --nnodes=1:3 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT
--rdzv_id=JOB /opt/tidepool/torch_ddp.py`: it ends the agent once its worker acked and exits
with the ack exit code); alone, it trains in one process. Every step all ranks agree (an all-reduce of a flag) whether any of them got the notice
or SIGTERM; then rank 0 saves the model and the step to TP_STORE (key torch-ddp), the ranks
that were told ack and exit (TP_ACK_EXIT_CODE), the others exit TP_PEER_EXIT_CODE to be
restarted. A new start resumes from the saved step. Logs `rank R: step=N loss=X`.

Settings: TP_DIM (16), TP_BATCH (32), TP_LR (0.05), TP_STEPS (0: never done), TP_STEP_DELAY_MS
(100), TP_LOG_EVERY (10), TP_CHECKPOINT_EVERY (0: only on the notice), TP_SEED (1).
"""

from __future__ import annotations

import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tidepool_notice as tp  # noqa: E402

KEY = "torch-ddp"


def main() -> None:
    notice = tp.Notice()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = tp.env_int("RANK", 0), tp.env_int("WORLD_SIZE", 1)
    dim, batch, lr = tp.env_int("TP_DIM", 16), tp.env_int("TP_BATCH", 32), tp.env_float("TP_LR", 0.05)
    steps, log_every = tp.env_int("TP_STEPS", 0), max(1, tp.env_int("TP_LOG_EVERY", 10))
    every, seed = tp.env_int("TP_CHECKPOINT_EVERY", 0), tp.env_int("TP_SEED", 1)
    delay = tp.env_int("TP_STEP_DELAY_MS", 100) / 1000
    store = tp.Store.from_env()
    distributed = "MASTER_ADDR" in os.environ
    if distributed:
        if rank > 0 and "TORCHELASTIC_RUN_ID" not in os.environ:
            # PyTorchJob starts every pod at once: wait for the master, watching the notice.
            tp.wait_for_port(os.environ["MASTER_ADDR"], tp.env_int("MASTER_PORT", 23456), notice)
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
        rank, world = dist.get_rank(), dist.get_world_size()

    truth = torch.Generator().manual_seed(seed)
    w_true, b_true = torch.randn(dim, 1, generator=truth), torch.randn(1, generator=truth)
    model = torch.nn.Linear(dim, 1)
    step = 0
    if rank == 0:
        saved = tp.load(store, KEY)
        if saved is not None:
            step, _, arrays = saved
            model.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()})
    if distributed:
        t = torch.tensor([step])
        dist.broadcast(t, 0)
        step = int(t.item())
        model = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
    tp.log(f"rank {rank}: {'resumed at step ' + str(step) if step else 'fresh'} (world {world})")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    module = model.module if distributed else model

    def checkpoint() -> None:
        if rank == 0:
            tp.save(store, KEY, step, step * batch,
                    {k: v.detach().numpy() for k, v in module.state_dict().items()})

    while True:
        why = notice.reason()
        flag = torch.tensor([1 if why else 0])
        if distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            tp.log(f"rank {rank}: {why or 'a peer got the notice'}: stopping at step {step}")
            checkpoint()
            if distributed:
                dist.barrier()  # nobody leaves before the save
            why = why or notice.wait(3)  # told too, a moment after a peer?
            if why and not notice.restart():  # torchrun's agent re-forming the job tells nothing
                tp.ack(step, step * batch)
                tp.exit_acked()
            tp.exit_for_peer("notice")
        if steps and step >= steps:
            checkpoint()
            tp.log(f"rank {rank}: done at step {step}")
            return
        g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + step)
        x = torch.randn(batch, dim, generator=g)
        y = x @ w_true + b_true + 0.01 * torch.randn(batch, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients
        opt.step()
        step += 1
        if step == 1 or step % log_every == 0:
            tp.log(f"rank {rank}: step={step} loss={loss.item():.6f}")
        if every and step % every == 0:
            checkpoint()
        time.sleep(delay)


if __name__ == "__main__":
    main()
