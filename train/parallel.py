"""Fully sharded data parallel (FSDP2) training, kept apart from the model and the loop.

``FullyShardedStrategy`` is Lightning's ``ModelParallelStrategy`` with every device in one
data-parallel (sharding) dimension and no tensor parallelism, saving one full checkpoint file:
the same file layout as DDP, so resume, ``sinklm stream-eval`` and ``sinklm export`` read it
unchanged. The sharding itself is :func:`shard_model`, which ``SinkLMModule.configure_model``
applies when the strategy gives it a device mesh (as torchtitan does: each block its own unit,
then the root for the embeddings, final norm and head).

    sinklm fit --config configs/experiments/pythia-410m-vanilla.yaml \\
        --trainer.strategy sinklm.train.parallel.FullyShardedStrategy
"""

from __future__ import annotations

from datetime import timedelta

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from sinklm.models import CausalLM
from sinklm.models.compat import set_data_parallel_size


class FullyShardedStrategy(ModelParallelStrategy):
    """FSDP2 over all devices of all nodes, one full-state checkpoint file.

    Args:
        process_group_backend: ``nccl`` on GPUs by default; ``gloo`` on CPU.
        timeout: collective timeout.
    """

    def __init__(self, process_group_backend: str | None = None,
                 timeout: timedelta | None = None) -> None:
        kwargs = {} if timeout is None else {"timeout": timeout}
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=False,
                         process_group_backend=process_group_backend, **kwargs)

    def setup_environment(self) -> None:
        """Every device of every node in one sharding dimension (known only by now)."""
        set_data_parallel_size(self, self.num_nodes * self.num_processes)
        super().setup_environment()


def shard_model(model: CausalLM, mesh: DeviceMesh, compile_blocks: bool = False) -> None:
    """Shard ``model`` in place over ``mesh``: each transformer block is one FSDP unit
    (gathered for its forward and backward only), the root holds the rest."""
    for block in model.gpt_neox.layers:
        if compile_blocks:  # compile before sharding, block by block (torchtitan's order)
            block.compile()
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def total_norm(tensors: list[Tensor]) -> Tensor:
    """The 2-norm of all ``tensors`` together, also when they are FSDP2 shards (DTensors)."""
    norm = torch.nn.utils.get_total_norm(tensors)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
