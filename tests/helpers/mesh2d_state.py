"""A state of DTensors on a 2-D mesh of 4 ranks, under trainjob.Run (tests/engine/test_fsdp_example.py).

    trainjob torchrun --standalone --nproc-per-node 4 tests/helpers/mesh2d_state.py PVC [DIE_AT]

``a`` is placed (Replicate, Shard(0)) as HSDP places a parameter: each half of the mesh holds a
shard, its two replicas each write half of it; ``b`` (Shard(0), Shard(1)) is a block of rows and
columns per rank, stored with offsets along both axes. Each step adds 1 to ``a`` and doubles ``b``;
with DIE_AT the launch ends abruptly in that step's body (after the previous checkpoint). At the
end rank 0 checks the whole values against the arithmetic (a resume that loaded any element from
the wrong place fails here), and the gate publishes both, gathered tensor by tensor.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import trainjob

STEPS = 4
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2))
a0, b0 = torch.arange(35.0).reshape(7, 5), torch.arange(36.0).reshape(6, 6)
a = distribute_tensor(a0.clone(), mesh, [Replicate(), Shard(0)])
b = distribute_tensor(b0.clone(), mesh, [Shard(0), Shard(1)])


class State:
    def state_dict(self):
        return {"a": a, "b": b}

    def load_state_dict(self, sd):
        a.to_local().copy_(sd["a"].to_local())
        b.to_local().copy_(sd["b"].to_local())


die_at = int(sys.argv[2]) if len(sys.argv) > 2 else None
with trainjob.Run(sys.argv[1], state=State(), steps=STEPS, ckpt_every=2, name="mesh2d") as run:
    for step in run:
        if step == die_at:
            os._exit(9)
        with torch.no_grad():
            a.to_local().add_(1)
            b.to_local().mul_(2)
        run.report(0.0)
    whole_a, whole_b = a.full_tensor(), b.full_tensor()
    if dist.get_rank() == 0 and not (torch.equal(whole_a, a0 + STEPS) and torch.equal(whole_b, b0 * 2 ** STEPS)):
        raise SystemExit("the resumed values are not the arithmetic's")
    run.gate(holdout=trainjob.Score(correct=1, total=1), baseline=trainjob.Score(correct=1, total=1),
             export={"a": a, "b": b})
dist.destroy_process_group()
sys.exit(run.exit_code)
