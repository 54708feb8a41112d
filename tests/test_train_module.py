"""The LightningModule's recipe (AdamW groups, schedule) and its non-finite loss guard."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.train_data import TinyData
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

from sinklm.models.checkpoint import load_trained, read_checkpoint
from sinklm.models.config import ConfigError
from sinklm.train.callbacks import StepCheckpoint
from sinklm.train.data_module import SinkLMDataModule
from sinklm.train.fit_cli import check_strategy
from sinklm.train.module import (
    NonFiniteLossError,
    OptimizerConfig,
    SinkLMModule,
    lr_multiplier,
    parameter_groups,
)
from sinklm.train.parallel import FullyShardedStrategy


def test_schedule_by_hand() -> None:
    """1000 steps: warmup over 10 steps to the peak, cosine to 10% at the last step."""
    assert lr_multiplier(0, 1000, 0.01, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(9, 1000, 0.01, 0.1) == pytest.approx(1.0)
    halfway = 10 + (1000 - 10) / 2
    assert lr_multiplier(int(halfway), 1000, 0.01, 0.1) == pytest.approx(0.55, abs=1e-3)
    assert lr_multiplier(1000, 1000, 0.01, 0.1) == pytest.approx(0.1)
    values = [lr_multiplier(s, 1000, 0.01, 0.1) for s in range(10, 1001)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_weight_decay_groups() -> None:
    """Decay: embeddings, the head and weight matrices. No decay: biases, norms, sink logits."""
    module = SinkLMModule(preset="tiny-1m", variant="sink_logit")
    decay, no_decay = parameter_groups(module.model, 0.1)
    names = {id(p): n for n, p in module.model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert "gpt_neox.embed_in.weight" in decayed and "embed_out.weight" in decayed
    assert "gpt_neox.layers.0.attention.query_key_value.weight" in decayed
    assert "gpt_neox.layers.0.attention.query_key_value.bias" in kept
    assert "gpt_neox.layers.0.input_layernorm.weight" in kept
    assert "gpt_neox.layers.0.attention.sink_logit" in kept
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert len(decayed) + len(kept) == len(names)


def test_module_applies_variant_and_overrides() -> None:
    module = SinkLMModule(preset="tiny-1m", variant="zero_sink", sink_tokens=2,
                          model_overrides={"vocab_size": 640})
    assert module.config.attention.softmax == "softmax1"
    assert module.config.sink_tokens == 2 and module.config.vocab_size == 640


class PoisonAt(L.Callback):
    """Make the loss NaN at one step, as a diverging run would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            original = module.loss

            def nan_loss(batch):
                module.loss = original
                return original(batch) * float("nan")

            module.loss = nan_loss


def make_run(train_data: TinyData, root: Path, policy: str, steps: int = 6):
    torch.manual_seed(0)
    module = SinkLMModule(
        preset="tiny-1m", variant="vanilla", on_nonfinite=policy,
        model_overrides={"vocab_size": 640, "d_model": 32, "n_head": 2, "max_seq_len": 64},
        optimizer=OptimizerConfig(lr=1e-3),
    )
    data = SinkLMDataModule(path=str(train_data.packed), seq_len=64, sink_tokens=0,
                            vocab_size=640, micro_batch_size=4, num_workers=0)
    checkpoint = StepCheckpoint(dirpath=root, every_n_train_steps=2, save_last=True,
                                save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[checkpoint, PoisonAt(3)],
        limit_val_batches=0, default_root_dir=root,
    )
    return module, data, trainer


def test_nonfinite_loss_stops_and_keeps_good_checkpoint(
    train_data: TinyData, tmp_path: Path
) -> None:
    module, data, trainer = make_run(train_data, tmp_path, "stop")
    with pytest.raises(NonFiniteLossError, match=r"lower optimizer\.lr"):
        trainer.fit(module, data)
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["global_step"] == 2  # the step-2 checkpoint; nothing after the NaN was saved
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())
    assert all(torch.isfinite(p).all() for p in module.parameters())  # not updated with NaN


def test_nonfinite_loss_skip_policy_goes_on(
    train_data: TinyData, tmp_path: Path
) -> None:
    module, data, trainer = make_run(train_data, tmp_path, "skip")
    trainer.fit(module, data)
    assert module.skipped_batches == 1
    assert trainer.global_step == 6  # the poisoned batch was dropped, training went on
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert math.isfinite(trainer.callback_metrics["train/loss"].item())


def test_compile_switch_keeps_checkpoint_keys() -> None:
    plain = SinkLMModule(preset="tiny-1m")
    compiled = SinkLMModule(preset="tiny-1m", compile=True)
    compiled.configure_model()
    assert compiled.model._compiled_call_impl is not None
    assert plain.model._compiled_call_impl is None
    assert list(compiled.state_dict()) == list(plain.state_dict())


def test_interrupted_checkpoint_write_keeps_the_previous_file(
    train_data: TinyData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that dies half-way (disk full, kill) leaves the old checkpoint intact."""
    from fsspec.implementations.local import LocalFileOpener

    module, data, trainer = make_run(train_data, tmp_path, "skip", steps=2)
    trainer.fit(module, data)
    last = tmp_path / "last.ckpt"
    before, files = last.read_bytes(), sorted(p.name for p in tmp_path.iterdir())
    write = LocalFileOpener.write

    def write_half_then_fail(self, data):
        write(self, data[: len(data) // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(LocalFileOpener, "write", write_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        trainer.save_checkpoint(last)
    assert last.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # no half-written leftovers
    assert torch.load(last, weights_only=False)["global_step"] == 2


def test_throughput_and_sink_probe_metrics(
    train_data: TinyData, tmp_path: Path
) -> None:
    """MFU = tokens/s x FLOPs per token / peak; the probe's first-position mass and Sink_1^eps
    equal a hand computation from the eager attention probabilities of the final model."""
    from lightning.pytorch.loggers import CSVLogger

    from sinklm.train.callbacks import SinkProbe, Throughput

    module, data, _ = make_run(train_data, tmp_path, "stop", steps=4)
    probe = SinkProbe(every_n_steps=4, eps=0.05, max_rows=2)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=4, logger=CSVLogger(tmp_path, name="logs"),
        log_every_n_steps=2, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0,
        callbacks=[Throughput(peak_flops=1e12), probe],
    )
    trainer.fit(module, data)
    logged = trainer.logged_metrics
    flops = module.config.training_flops_per_token(64)
    assert logged["perf/mfu"].item() == pytest.approx(
        logged["perf/tokens_per_s"].item() * flops / 1e12, rel=1e-5)

    row = probe.history[-1]
    assert row["step"] == 4 and row["tokens"] == 4 * 4 * 64
    windows = next(iter(data.probe_dataloader()))["input_ids"][:2]
    module.eval()
    with torch.no_grad():
        _, probs = module.model.forward_with_attentions(windows)
    t = windows.shape[1]
    for layer, p in enumerate(probs):  # p: [B, H, T, S]; mean over queries of A[t, 0]
        alpha = p[..., 0].sum(-1) / t  # [B, H]: every query t >= 0 sees position 0
        per_head = alpha.mean(0)
        assert row["first_mass"][layer] == pytest.approx(per_head.mean().item(), abs=1e-5)
    heads = torch.stack([(p[..., 0].sum(-1) / t).mean(0) for p in probs])
    assert row["sink_rate"] == pytest.approx((heads > 0.05).float().mean().item())


def test_last_checkpoint_holds_the_final_step(train_data: TinyData, tmp_path: Path) -> None:
    """5 steps, checkpoints every 2: `last` still ends at step 5, not 4 (the batch poisoned
    at step 3 is skipped and does not count as a step)."""
    module, data, trainer = make_run(train_data, tmp_path, "skip", steps=5)
    trainer.fit(module, data)
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 5


def test_saved_checkpoint_loads_the_trained_network(train_data: TinyData, tmp_path: Path) -> None:
    """The module's checkpoint keeps the on-disk key strings (older checkpoints still load) and
    loads through ``sinklm.models.checkpoint`` into a network with the trained module's logits."""
    module, data, trainer = make_run(train_data, tmp_path, "skip", steps=2)
    trainer.fit(module, data)
    path = tmp_path / "last.ckpt"
    checkpoint = read_checkpoint(path)
    assert checkpoint["global_step"] == 2
    assert checkpoint["sinklm_model_config"] == module.config.to_dict()
    assert checkpoint["sinklm_tokenizer"] == data.tokenizer.to_str()
    assert checkpoint["sinklm_sink_token_ids"] == data.sink_ids == []
    assert checkpoint["sinklm_data"] == data.identity()
    model, tokenizer, sink_ids = load_trained(checkpoint, path)
    assert tokenizer.to_str() == data.tokenizer.to_str() and sink_ids == []
    ids = torch.randint(0, 640, (2, 64), generator=torch.Generator().manual_seed(0))
    module.eval()
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), module(ids))
    # Evaluation reads it in a fresh process without Lightning or any sinklm.train class.
    code = (
        "import sys\nfrom sinklm.models.load import load_checkpoint\n"
        f"load_checkpoint({str(path)!r})\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'lightning'\n"
        "            or m.startswith('sinklm.train')], 'imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_lightning_fsdp1_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"sinklm\.train\.parallel\.FullyShardedStrategy"):
        check_strategy(FSDPStrategy())
    check_strategy(FullyShardedStrategy())
    check_strategy(DDPStrategy())


class PoisonBatch(L.Callback):
    """Make one micro-batch's loss NaN, or one of its gradients inf after backward."""

    def __init__(self, kind: str, batch_idx: int) -> None:
        self.kind, self.batch_idx, self.active = kind, batch_idx, False

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.active = batch_idx == self.batch_idx
        if self.active and self.kind == "loss":
            original = module.loss

            def nan_loss(batch):
                module.loss = original
                return original(batch) * float("nan")

            module.loss = nan_loss

    def on_after_backward(self, trainer, module) -> None:
        if self.active and self.kind == "grad":
            next(module.parameters()).grad.view(-1)[0] = float("inf")


def snapshot(module: SinkLMModule, trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """Copies of every weight and of AdamW's state (exp_avg, exp_avg_sq, step per parameter)."""
    state = trainer.optimizers[0].state_dict()["state"]
    weights = {f"weight/{k}": v.detach().clone() for k, v in module.state_dict().items()}
    return weights | {f"adamw/{i}/{k}": v.clone() for i, s in state.items() for k, v in s.items()}


class StateAfterEachStep(L.Callback):
    """``states[k]``: the snapshot once k optimizer steps have run."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.states.setdefault(trainer.global_step, snapshot(module, trainer))


class CountReduces(L.Callback):
    """Counts the strategy's cross-rank reduces once training has started (the finiteness
    check is one reduce and one host read of its result)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer, module) -> None:
        reduce = trainer.strategy.reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return reduce(*args, **kwargs)

        trainer.strategy.reduce = counted


def identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def poisoned_run(train_data: TinyData, root: Path, policy: str, kind: str, accumulate: int,
                 steps: int = 6) -> tuple[SinkLMModule, SinkLMDataModule, L.Trainer,
                                          StateAfterEachStep, CountReduces]:
    """A run whose step 3 (its last micro-batch) has a non-finite loss or gradient."""
    module, data, _ = make_run(train_data, root, policy, steps=steps)
    states, reduces = StateAfterEachStep(), CountReduces()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        callbacks=[states, reduces, PoisonBatch(kind, batch_idx=4 * accumulate - 1)],
        default_root_dir=root,
    )
    return module, data, trainer, states, reduces


@pytest.mark.parametrize(("kind", "accumulate"), [("grad", 1), ("loss", 2), ("grad", 2)])
def test_skipped_step_leaves_weights_and_adamw_state_bit_identical(
    train_data: TinyData, tmp_path: Path, kind: str, accumulate: int
) -> None:
    """Under ``skip`` the poisoned step changes no weight and no AdamW moment or step count
    (zeroed gradients would still move both), also when the micro-batch before it was good;
    the steps around it do train. Finiteness costs one reduce (one host read) per step, and
    the skipped batch still counts as a step of the run and of the LR schedule."""
    module, data, trainer, states, reduces = poisoned_run(
        train_data, tmp_path, "skip", kind, accumulate
    )
    trainer.fit(module, data)
    assert module.skipped_batches == 1 and reduces.calls == 6
    assert identical(states.states[3], states.states[4])
    assert not identical(states.states[2], states.states[3])
    assert not identical(states.states[4], states.states[5])
    assert trainer.global_step == 6
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 6


def test_nonfinite_gradient_stops_before_the_update(
    train_data: TinyData, tmp_path: Path
) -> None:
    """Under ``stop`` an inf gradient with a finite loss raises, and nothing was updated."""
    module, data, trainer, states, _ = poisoned_run(train_data, tmp_path, "stop", "grad", 1)
    with pytest.raises(NonFiniteLossError, match=r"gradient norm is inf at step 3"):
        trainer.fit(module, data)
    assert identical(states.states[3], snapshot(module, trainer))
