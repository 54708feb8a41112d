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


def plan_batch(global_batch: int, micro_batch: int, world: int) -> tuple[int, int]:
    """(micro-batch, accumulation) that reach ``global_batch`` on ``world`` GPUs.

    As litgpt and gpt-neox do, accumulation is derived: each GPU's share of the global batch
    over the micro-batch. A micro-batch larger than the share is lowered to it (a GPU never
    holds more than its share, and fewer sequences always fit), so one config runs unchanged on
    4 to 32 GPUs. What cannot divide is refused, naming the micro-batches that would.
    """
    if global_batch < 1 or micro_batch < 1:
        raise ConfigError(f"data.global_batch_size={global_batch}, data.micro_batch_size="
                          f"{micro_batch}: both must be >= 1")
    if global_batch % world:
        raise ConfigError(
            f"data.global_batch_size={global_batch} cannot be split evenly over {world} GPUs; "
            f"use a GPU count that divides {global_batch}, or another global batch"
        )
    share = global_batch // world
    micro = min(micro_batch, share)
    if share % micro:
        would = [d for d in range(1, share + 1) if share % d == 0]
        below = max(d for d in would if d < micro)
        above = min(d for d in would if d > micro)
        raise ConfigError(
            f"data.micro_batch_size={micro_batch} does not divide each GPU's share of the "
            f"global batch ({global_batch} / {world} GPUs = {share}); "
            f"data.micro_batch_size={below} would (or {above}, if it fits in memory)"
        )
    return micro, share // micro
