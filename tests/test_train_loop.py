"""`sinklm fit` end to end on CPU: exact resume after SIGKILL, DDP, FSDP2, SLURM preemption,
bad input."""

from __future__ import annotations

import csv
import os
import signal
import stat
from pathlib import Path

import pytest
import torch
import yaml
from helpers.train_data import TinyData, run_fit, tiny_config


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def losses(root: Path) -> dict[int, float]:
    """step -> training loss, from every CSV log of a run (a resumed run adds a version)."""
    found: dict[int, float] = {}
    for log in sorted(root.glob("logs/version_*/metrics.csv")):
        for row in csv.DictReader(log.open()):
            if row.get("train/loss"):
                found[int(row["step"])] = float(row["train/loss"])
    return found


def probes(root: Path) -> dict[int, float]:
    """step -> attention mass on the first position in layer 0, from the sink probe's logs."""
    return {int(row["step"]): float(row["sinks/first_mass_layer0"])
            for log in sorted(root.glob("logs/version_*/metrics.csv"))
            for row in csv.DictReader(log.open()) if row.get("sinks/first_mass_layer0")}


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]


def assert_ok(result) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def test_resume_after_sigkill_is_exact(train_data: TinyData, tmp_path: Path) -> None:
    """2N steps straight, or killed at N+2 and resumed from the step-N checkpoint: the same
    loss at every step and bit-identical final weights."""
    n = 4
    straight = tmp_path / "straight"
    assert_ok(run_fit(write_config(tmp_path / "a.yaml",
                                   tiny_config(train_data, straight, steps=2 * n,
                                               checkpoint_every=n))))
    crashed = tmp_path / "crashed"
    killer = [{"class_path": "train_probes.KillAtStep", "init_args": {"step": n + 2}}]
    config = write_config(tmp_path / "b.yaml", tiny_config(
        train_data, crashed, steps=2 * n, checkpoint_every=n, callbacks=killer))
    killed = run_fit(config)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (crashed / "checkpoints" / f"step{n:08d}.ckpt").is_file()
    assert not (crashed / "checkpoints" / f"step{2 * n:08d}.ckpt").exists()

    resumed = run_fit(write_config(tmp_path / "c.yaml", tiny_config(
        train_data, crashed, steps=2 * n, checkpoint_every=n)))
    assert_ok(resumed)
    assert "resuming from" in resumed.stderr  # last.ckpt: the step-N state, saved after it

    expected, got = losses(straight), losses(crashed)
    assert sorted(expected) == list(range(2 * n)) and sorted(got) == sorted(expected)
    assert got == expected  # exact floats: same batches, same state, same arithmetic
    final = f"step{2 * n:08d}.ckpt"
    a, b = weights(straight / "checkpoints" / final), weights(crashed / "checkpoints" / final)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_cpu_ddp_two_ranks(train_data: TinyData, tmp_path: Path) -> None:
    """Two gloo processes: disjoint batches, identical weights at the end."""
    record = tmp_path / "record"
    config = tiny_config(
        train_data, tmp_path / "run", steps=3, checkpoint_every=3,
        callbacks=[{"class_path": "train_probes.RecordRun",
                    "init_args": {"directory": str(record)}}],
        extra_trainer={"devices": 2, "strategy": "ddp"},
    )
    assert_ok(run_fit(write_config(tmp_path / "ddp.yaml", config)))
    ranks = [torch.load(record / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    rows = [{tuple(row.tolist()) for batch in rank["batches"] for row in batch} for rank in ranks]
    assert len(rows[0]) == len(rows[1]) == 3 * 4
    assert not rows[0] & rows[1]
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][name]), name


FULLY_SHARDED = {"class_path": "sinklm.train.parallel.FullyShardedStrategy",
                 "init_args": {"process_group_backend": "gloo"}}


def test_fully_sharded_matches_ddp_and_resumes_exactly(train_data: TinyData,
                                                       tmp_path: Path) -> None:
    """FSDP2 over 2 gloo ranks: the same losses as DDP (one reduction order apart), one full
    checkpoint file that evaluation reads, and an exact resume after both ranks are killed."""
    n = 2

    def config(root: Path, strategy: object, callbacks: list | None = None) -> Path:
        settings = tiny_config(train_data, root, steps=2 * n, checkpoint_every=n,
                               callbacks=callbacks,
                               extra_trainer={"devices": 2, "strategy": strategy})
        settings["sink_probe"] = {"every_n_steps": n}  # a forward on gathered weights
        return write_config(root.with_suffix(".yaml"), settings)

    ddp, sharded, crashed = tmp_path / "ddp", tmp_path / "sharded", tmp_path / "crashed"
    assert_ok(run_fit(config(ddp, "ddp")))
    assert_ok(run_fit(config(sharded, FULLY_SHARDED)))
    expected, got = losses(ddp), losses(sharded)
    assert sorted(got) == list(range(2 * n))
    assert got[0] == expected[0]  # same weights and batches: the first loss is exact
    assert got == pytest.approx(expected, rel=1e-5)
    assert sorted(probes(ddp)) == [n, 2 * n]
    assert probes(sharded) == pytest.approx(probes(ddp), abs=1e-5)
    final = f"step{2 * n:08d}.ckpt"
    a, b = weights(ddp / "checkpoints" / final), weights(sharded / "checkpoints" / final)
    assert a.keys() == b.keys()
    for name in a:  # full tensors, not shards
        assert b[name].shape == a[name].shape
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-3, msg=name)
    from sinklm.models.load import load_checkpoint

    evaluated = load_checkpoint(sharded / "checkpoints" / final).model.state_dict()
    assert all(torch.equal(value, b[f"model.{name}"]) for name, value in evaluated.items())

    killer = [{"class_path": "train_probes.KillAtStep", "init_args": {"step": n + 1}}]
    killed = run_fit(config(crashed, FULLY_SHARDED, killer))
    assert killed.returncode != 0
    assert not (crashed / "checkpoints" / final).exists()
    assert_ok(run_fit(config(crashed, FULLY_SHARDED)))
    assert losses(crashed) == got  # exact: same state restored on every rank
    resumed = weights(crashed / "checkpoints" / final)
    for name in b:
        assert torch.equal(resumed[name], b[name]), name


SLURM_ENVIRONMENT = "lightning.pytorch.plugins.environments.SLURMEnvironment"


def fake_scontrol(directory: Path) -> Path:
    """An `scontrol` that records its arguments (no cluster here)."""
    directory.mkdir()
    script = directory / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {directory}/calls.txt\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return directory


def slurm_env(bin_dir: Path) -> dict[str, str]:
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "sinklm-test", "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_NODELIST": "localhost",
    }


def test_sigusr1_saves_requeues_and_resumes(train_data: TinyData, tmp_path: Path) -> None:
    bin_dir = fake_scontrol(tmp_path / "bin")
    root = tmp_path / "run"
    signal_at = [{"class_path": "train_probes.SignalAtStep", "init_args": {"step": 3}}]
    config = tiny_config(train_data, root, steps=5, checkpoint_every=100, callbacks=signal_at,
                         extra_trainer={"plugins": {"class_path": SLURM_ENVIRONMENT,
                                                    "init_args": {"auto_requeue": True}}})
    first = run_fit(write_config(tmp_path / "slurm.yaml", config), env=slurm_env(bin_dir))
    assert_ok(first)
    assert (bin_dir / "calls.txt").read_text().split() == ["requeue", "4242"]
    hpc = list(root.glob("hpc_ckpt_*.ckpt"))
    assert len(hpc) == 1
    hpc_step = torch.load(hpc[0], map_location="cpu", weights_only=False)["global_step"]
    assert hpc_step == 3

    # The requeued job: the same command. The step-5 `last` checkpoint is newer than the hpc
    # one here, so make the hpc one the newest, as after a real preemption.
    os.utime(hpc[0])
    config["trainer"]["callbacks"] = []
    config["trainer"]["max_steps"] = 6
    second = run_fit(write_config(tmp_path / "slurm2.yaml", config), env=slurm_env(bin_dir))
    assert_ok(second)
    assert f"resuming from {hpc[0]}" in second.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["model"].update(heads=3), "heads"),
        (lambda c: c["data"].update(global_batch_size=6), "global_batch_size=6"),
        (lambda c: c["data"].update(path="/nonexistent/packed"), "/nonexistent/packed"),
        (lambda c: c["data"].update(seq_len=128), "seq_len=128"),
        (lambda c: c["model"]["model_overrides"].update(vocab_size=512), "vocab_size=512"),
    ],
)
def test_bad_config_fails_before_training(train_data: TinyData, tmp_path: Path, change,
                                          message: str) -> None:
    config = tiny_config(train_data, tmp_path / "run")
    change(config)
    result = run_fit(write_config(tmp_path / "bad.yaml", config))
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_resume_into_another_variant_is_refused(train_data: TinyData, tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert_ok(run_fit(write_config(tmp_path / "a.yaml",
                                   tiny_config(train_data, root, steps=2, checkpoint_every=2))))
    before = (root / "checkpoints" / "last.ckpt").read_bytes()
    other = tiny_config(train_data, root, variant="zero_sink", steps=4)
    result = run_fit(write_config(tmp_path / "b.yaml", other))
    assert result.returncode == 2
    assert "another model" in result.stderr and "softmax1" in result.stderr
    assert (root / "checkpoints" / "last.ckpt").read_bytes() == before


def test_checkpoint_loads_for_evaluation(train_data: TinyData, tmp_path: Path) -> None:
    """A `sinklm fit` checkpoint carries what evaluation needs: config, weights, tokenizer
    with its sink token, sink ids; and `sinklm stream-eval` runs on it."""
    from tokenizers import Tokenizer

    from sinklm.cli.main import main as sinklm_main
    from sinklm.models.load import load_checkpoint

    root = tmp_path / "run"
    config = tiny_config(train_data, root, steps=2, checkpoint_every=2)
    config["sink_probe"] = {"every_n_steps": 1}
    assert_ok(run_fit(write_config(tmp_path / "a.yaml", config)))
    path = root / "checkpoints" / "last.ckpt"
    loaded = load_checkpoint(path)
    logged = {int(row["step"]): row for row in csv.DictReader(
        next(root.glob("logs/version_*/metrics.csv")).open()) if row["sinks/sink_rate_eps0.3"]}
    assert [row["step"] for row in loaded.training_sinks] == sorted(logged) == [1, 2]
    for row in loaded.training_sinks:  # the probe's record travels with the checkpoint
        log = logged[row["step"]]
        assert row["sink_rate"] == pytest.approx(float(log["sinks/sink_rate_eps0.3"]))
        assert row["first_mass"][1] == pytest.approx(float(log["sinks/first_mass_layer1"]))
        assert row["tokens"] == row["step"] * 4 * 64  # micro-batch x seq_len, one device
    trained_vocab = Tokenizer.from_file(str(train_data.tokenizer)).get_vocab_size()
    assert loaded.sink_token_ids == [trained_vocab]  # the first free id
    assert loaded.tokenizer.id_to_token(trained_vocab) == "<|sink|>"
    assert loaded.model.config.sink_tokens == 1 and loaded.name == (
        "tiny-1m+d_model=32+max_seq_len=64+n_head=2+vocab_size=640-sink_token")  # as trained
    saved = weights(path)
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, saved[f"model.{name}"]), name
    output = tmp_path / "stream.json"
    code = sinklm_main(["stream-eval", "--checkpoint", str(path), "--text",
                        str(train_data.packed.parent / "book.txt"), "--cache", "1+15,dense",
                        "--output", str(output)])
    assert code == 0 and output.is_file()

    report = tmp_path / "report"
    code = sinklm_main(["compare", str(path), "--text", str(train_data.packed.parent / "book.txt"),
                        "--cache", "1+15", "--max-tokens", "300", "--output", str(report)])
    assert code == 0 and (report / "sinks_training.png").is_file()
    assert "## Sinks during training" in (report / "report.md").read_text()


def test_checkpoint_exports_for_transformers(train_data: TinyData, tmp_path: Path) -> None:
    """`sinklm export` on a `sinklm fit` checkpoint: transformers loads it, same logits,
    and its tokenizer puts the sink in front of the text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sinklm.cli.main import main as sinklm_main
    from sinklm.models.load import load_checkpoint

    root = tmp_path / "run"
    assert_ok(run_fit(write_config(tmp_path / "a.yaml",
                                   tiny_config(train_data, root, steps=2, checkpoint_every=2))))
    path = root / "checkpoints" / "last.ckpt"
    out = tmp_path / "export"
    assert sinklm_main(["export", "--checkpoint", str(path), "--output", str(out)]) == 0
    ours = load_checkpoint(path)
    hf_model = AutoModelForCausalLM.from_pretrained(out).eval()
    encoded = AutoTokenizer.from_pretrained(out)("It was a dark night.", return_tensors="pt")
    ids = encoded["input_ids"]
    assert ids[0, 0].item() == ours.sink_token_ids[0]
    with torch.no_grad():
        assert (hf_model(ids).logits - ours.model(ids)).abs().max().item() < 1e-4
