"""Global batch arithmetic, checked before any compute starts."""

from __future__ import annotations

from sinklm.models.config import ConfigError


def check_global_batch(
    global_batch: int, micro_batch: int, devices: int, nodes: int, accumulate: int
) -> None:
    """Global batch = micro-batch x devices x nodes x accumulation; refuse anything else."""
    reached = micro_batch * devices * nodes * accumulate
    if reached == global_batch:
        return
    per_step = micro_batch * devices * nodes
    hint = (
        f"set trainer.accumulate_grad_batches={global_batch // per_step}"
        if global_batch % per_step == 0
        else f"pick data.micro_batch_size so that {global_batch} is a multiple of "
        f"micro_batch x {devices * nodes} devices"
    )
    raise ConfigError(
        f"data.global_batch_size={global_batch} is not reached: micro_batch_size={micro_batch} "
        f"x devices={devices} x nodes={nodes} x accumulate_grad_batches={accumulate} = "
        f"{reached}; {hint}"
    )
