"""Train a small GPT with autopar on a 2x2x2 mesh of CPU processes and check it against serial training.

    python examples/train_gpt.py                                # starts 8 local gloo ranks itself
    torchrun --nproc-per-node 8 examples/train_gpt.py           # the same, started by torchrun
    python examples/train_gpt.py --mesh 2,4 --steps 10          # another mesh, more steps

Every rank runs `train`: the model is written in plain PyTorch (examples/models.py), autopar turns it
into a 3-D tensor-parallel module, and the training loop is the usual torch one. A serial copy of
the model trains beside it on the same batches; the losses must agree step by step.
"""

from __future__ import annotations

import argparse
import copy
import math
import multiprocessing as mp
import os
import socket
import sys
import time
from multiprocessing.connection import wait

import torch
import torch._dynamo  # noqa: F401  (imported before forking, so that the ranks need not)
import torch.distributed as dist
from models import gpt_batch, make_gpt
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.core.mesh import default_axis_names

SEED = 0
RTOL = 1e-4  # parallel and serial losses must agree to this relative tolerance


def train(mesh_shape: tuple[int, ...], steps: int) -> bool:
    """One rank's part; returns whether every parallel loss matched the serial one."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=default_axis_names(len(mesh_shape)))

    model, (idx, targets) = make_gpt(SEED)  # same seed on every rank: same weights, same batch
    serial = copy.deepcopy(model)
    start = time.perf_counter()
    pmodel = autopar.parallelize(model, mesh, example_inputs=(idx, targets))
    compile_s = time.perf_counter() - start

    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    serial_opt = torch.optim.AdamW(serial.parameters(), lr=1e-3)

    rows = []
    for step in range(steps):
        idx, targets = gpt_batch(serial.cfg, 8, torch.Generator().manual_seed(SEED + 1000 + step))
        losses = []
        for m, o in ((pmodel, opt), (serial, serial_opt)):
            o.zero_grad()
            loss = m(idx, targets)
            loss.backward()
            o.step()
            losses.append(loss.item())
        rows.append((step, *losses, abs(losses[0] - losses[1])))

    ok = all(diff <= RTOL * abs(serial_loss) for _, _, serial_loss, diff in rows)
    # Each rank checked its own losses; count the ranks that failed. Being the last collective, this
    # also keeps every rank here until all are done, so none tears down connections still in use.
    failed = torch.tensor([int(not ok)])
    dist.all_reduce(failed)
    if rank == 0:
        print(f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, parallelized in {compile_s:.1f} s")
        print(f"{'step':>4}  {'parallel loss':>14}  {'serial loss':>14}  {'|difference|':>12}")
        for step, parallel_loss, serial_loss, diff in rows:
            print(f"{step:>4}  {parallel_loss:>14.6f}  {serial_loss:>14.6f}  {diff:>12.2e}")
        print(pmodel.plan_summary())
        world = dist.get_world_size()
        if failed.item():
            print(f"FAILED: losses differ by more than {RTOL:g} relative on {failed.item()} of {world} ranks")
        else:
            print(f"OK: parallel and serial losses agree to {RTOL:g} relative on all {world} ranks")
    return not failed.item()


def run_rank(mesh_shape: tuple[int, ...], steps: int) -> int:
    """What each process does, however it was started (env:// reads what torchrun or we set)."""
    dist.init_process_group("gloo")
    try:
        return 0 if train(mesh_shape, steps) else 1
    finally:
        dist.destroy_process_group()


def launch_local(world_size: int, mesh_shape: tuple[int, ...], steps: int) -> int:
    """Start `world_size` ranks as forks of this process: torch is imported once, not once per rank."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size))

    def rank_main(rank: int) -> None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
        torch.set_num_threads(1)  # the ranks share this machine's cores
        sys.exit(run_rank(mesh_shape, steps))

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for p in procs:
        p.start()
    running = list(procs)
    while running:
        wait([p.sentinel for p in running])
        running = [p for p in procs if p.exitcode is None]
        if any(p.exitcode for p in procs):  # the others would wait for the failed rank forever
            for p in running:
                p.terminate()
    for p in procs:
        p.join()
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mesh", default="2,2,2", help="mesh shape, 1 to 4 comma-separated sizes")
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    args = parser.parse_args()
    mesh_shape = tuple(int(s) for s in args.mesh.split(","))
    world_size = math.prod(mesh_shape)

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        if int(os.environ["WORLD_SIZE"]) != world_size:
            parser.error(f"--mesh {args.mesh} needs {world_size} ranks, not {os.environ['WORLD_SIZE']}")
        return run_rank(mesh_shape, args.steps)
    return launch_local(world_size, mesh_shape, args.steps)


if __name__ == "__main__":
    sys.exit(main())
