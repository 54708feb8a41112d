"""Every private torch and Lightning name sinklm uses (models/compat.py) against the installed
upstream: a rename or a new signature fails here, by name, not in the middle of a run."""

from __future__ import annotations

import importlib
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from sinklm.models import compat
from sinklm.train.callbacks import (
    SinkProbe,
    StepCheckpoint,
    StepLines,
    StepProgressBar,
    Throughput,
)
from sinklm.train.data_module import SinkLMDataModule
from sinklm.train.fit_cli import SinkLMCLI
from sinklm.train.module import SinkLMModule
from sinklm.train.parallel import FullyShardedStrategy

# sinklm's subclasses of upstream classes, whose private overrides must be listed.
SUBCLASSES = (SinkLMCLI, StepCheckpoint, StepProgressBar, StepLines, Throughput, SinkProbe,
              FullyShardedStrategy, SinkLMModule, SinkLMDataModule)


def upstream(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_compat_imports_torch_alone() -> None:
    """It ships in exported folders, whose every import transformers requires."""
    from transformers.dynamic_module_utils import get_imports

    assert set(get_imports(compat.__file__)) <= {"__future__", "typing", "torch"}


def test_cpu_flash_kernel_gives_attention_and_its_lse() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    out, lse = compat.cpu_flash_attention(q, k, v, True, None, 8**-0.5)
    scores = (q @ k.transpose(-1, -2) * 8**-0.5).masked_fill(
        ~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    grad = torch.randn_like(out)
    grads = compat.cpu_flash_attention_backward(grad, q, k, v, out, lse, True, None, 8**-0.5)
    torch.testing.assert_close(grads, torch.autograd.grad(expected, (q, k, v), grad))


@pytest.mark.parametrize("t", [8, 1])
def test_cuda_kernels_keep_their_signatures(t: int) -> None:
    """On meta tensors, so a machine without CUDA checks the names and arguments too."""
    q = torch.empty(1, 2, t, 16, device="meta", dtype=torch.float16)
    k = v = torch.empty(1, 2, 8, 16, device="meta", dtype=torch.float16)
    out, lse, seed, offset = compat.cuda_flash_attention(q, k, v, t > 1, 0.25)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    grads = compat.cuda_flash_attention_backward(q, q, k, v, out, lse, seed, offset, t > 1, 0.25)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    bias = torch.empty(1, 2, t, 8, device="meta", dtype=torch.float16)
    out, lse, seed, offset = compat.efficient_attention(q, k, v, bias, False, 0.25)
    assert out.shape == q.shape and lse.shape[:2] == q.shape[:2]
    grads = compat.efficient_attention_backward(q, q, k, v, bias, out, lse, seed, offset, False,
                                                0.25)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_set_last_lr_is_what_the_scheduler_reports_and_saves() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    compat.set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]
    assert scheduler.state_dict()["_last_lr"] == [0.25]


def test_data_parallel_size_is_the_one_setup_environment_reads() -> None:
    strategy = ModelParallelStrategy()
    assert strategy._data_parallel_size == "auto"
    compat.set_data_parallel_size(strategy, 4)
    assert strategy._data_parallel_size == 4
    assert "self._data_parallel_size" in inspect.getsource(ModelParallelStrategy.setup_environment)


def test_model_checkpoint_last_save() -> None:
    callback = ModelCheckpoint()
    assert compat.last_saved_step(callback) == 0
    assert list(inspect.signature(ModelCheckpoint._save_last_checkpoint).parameters) == [
        "self", "trainer", "monitor_candidates"]
    assert list(inspect.signature(ModelCheckpoint._monitor_candidates).parameters) == [
        "self", "trainer"]


@pytest.mark.parametrize(("path", "name"), [
    (path, name) for path, names in compat.OVERRIDDEN_HOOKS.items() for name in names
])
def test_overridden_hooks_exist_upstream_and_are_called(path: str, name: str) -> None:
    cls = upstream(path)
    assert callable(getattr(cls, name, None)), f"{path}.{name} is gone"
    assert f"self.{name}(" in inspect.getsource(cls), f"{path} no longer calls {name}"


def test_every_private_override_is_listed() -> None:
    """A subclass method that replaces a private upstream one is in OVERRIDDEN_HOOKS."""
    listed = [(upstream(path), name) for path, names in compat.OVERRIDDEN_HOOKS.items()
              for name in names]
    for cls in SUBCLASSES:
        for name, value in vars(cls).items():
            private = name.startswith("_") and not name.startswith("__")
            upstream_too = any(hasattr(base, name) for base in cls.__mro__[1:])
            if private and inspect.isfunction(value) and upstream_too:
                assert any(issubclass(cls, base) and hook == name for base, hook in listed), (
                    f"{cls.__name__}.{name} overrides a private upstream method: list it in "
                    "models/compat.py's OVERRIDDEN_HOOKS")
