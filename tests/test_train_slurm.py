"""SLURM: rendered scripts for several shapes, rank mapping, global batch derivation, the log
folder."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from sinklm.cli.main import main as sinklm_main
from sinklm.models.config import ConfigError
from sinklm.train.batching import check_global_batch, plan_batch
from sinklm.train.slurm import fit_overrides, render

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "configs" / "experiments" / "pythia-160m-sink_token.yaml"
PAPER_160M = sorted((REPO / "configs" / "experiments").glob("pythia-160m-*.yaml"))


def directives(script: str) -> dict[str, str]:
    found = {}
    for key, value in re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", script, flags=re.M):
        found[key] = value
    return found


@pytest.mark.parametrize(("nodes", "gpus", "accumulate"), [(1, 8, 1), (4, 8, 1), (2, 4, 1)])
def test_rendered_script_shapes(tmp_path: Path, nodes: int, gpus: int, accumulate: int) -> None:
    config = yaml.safe_load(PAPER.read_text())
    # micro-batch chosen so that the global batch of 256 is reached on each shape
    config["data"]["micro_batch_size"] = 256 // (nodes * gpus * accumulate)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    script = render(path, nodes, gpus, partition="gpu", account="lab", time="02:00:00").script
    found = directives(script)
    assert found["nodes"] == str(nodes)
    assert found["ntasks-per-node"] == found["gpus-per-node"] == str(gpus)
    assert found["signal"] == "SIGUSR1@90" and "requeue" in found
    assert found["partition"] == "gpu" and found["account"] == "lab"
    assert found["time"] == "02:00:00"
    assert f"--trainer.num_nodes={nodes} --trainer.devices={gpus}" in script
    assert "srun" in script and "--ckpt_path=auto" in script
    checked = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr


def fit_command(script: str) -> dict[str, str]:
    """The ``--key=value`` arguments of the srun line; a repeated key keeps its last value."""
    command = shlex.split(script[script.index("srun "):].replace("\\\n", " "))
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


@pytest.mark.parametrize(("nodes", "gpus"), [(1, 4), (1, 8), (2, 8), (4, 8)])
@pytest.mark.parametrize("config", PAPER_160M, ids=lambda p: p.stem)
def test_paper_configs_submit_unchanged_on_every_shape(config: Path, nodes: int,
                                                       gpus: int) -> None:
    """Accumulation (and, past 8 GPUs, the micro-batch) is derived and handed to `sinklm fit`,
    whose own check (check_global_batch) then holds: the global batch stays 256."""
    job = render(config, nodes, gpus)
    args = fit_command(job.script)
    micro = int(args["data.micro_batch_size"])
    accumulate = int(args["trainer.accumulate_grad_batches"])
    assert (int(args["trainer.num_nodes"]), int(args["trainer.devices"])) == (nodes, gpus)
    check_global_batch(256, micro, devices=gpus, nodes=nodes, accumulate=accumulate)
    assert (micro, accumulate) == {4: (32, 2), 8: (32, 1), 16: (16, 1), 32: (8, 1)}[nodes * gpus]
    assert job.batch is not None and job.batch.startswith(f"global batch 256 = micro-batch {micro}")


def test_overrides_after_the_separator_are_applied_before_the_check() -> None:
    """The issue's two refused examples: the user's own accumulation, and a smaller micro-batch."""
    job = render(PAPER, 1, 4, fit_args=["--trainer.accumulate_grad_batches=2"])
    args = fit_command(job.script)
    assert args["trainer.accumulate_grad_batches"] == "2"
    assert job.script.count("--trainer.accumulate_grad_batches") == 1
    job = render(PAPER, 2, 8, fit_args=["--data.micro_batch_size", "16"])
    args = fit_command(job.script)
    assert (args["data.micro_batch_size"], args["trainer.accumulate_grad_batches"]) == ("16", "1")
    # A micro-batch of 8 on 8 GPUs: accumulation 4, and the global batch moves with the override.
    args = fit_command(render(PAPER, 1, 8, fit_args=["--data.micro_batch_size=8"]).script)
    assert args["trainer.accumulate_grad_batches"] == "4"
    args = fit_command(render(PAPER, 1, 8, fit_args=["--data.global_batch_size=512"]).script)
    assert args["trainer.accumulate_grad_batches"] == "2"


@pytest.mark.parametrize(
    ("nodes", "gpus", "fit_args", "message"),
    [
        (1, 8, ["--data.micro_batch_size=12"],
         r"micro_batch_size=12 does not divide .* \(256 / 8 GPUs = 32\); "
         r"data.micro_batch_size=8 would \(or 16"),
        (3, 8, [], "256 cannot be split evenly over 24 GPUs"),
        (1, 4, ["--trainer.accumulate_grad_batches=4"],
         "x accumulate_grad_batches=4 = 512; set trainer.accumulate_grad_batches=2"),
        (1, 8, ["--trainer.devices=4"], "--trainer.devices after --: .* use --gpus-per-node"),
        (4, 8, ["--data.micro_batch_size=32"],
         r"micro_batch_size=32 after -- is more than .* \(256 / 32 GPUs\); "
         "--data.micro_batch_size=8 would"),
        (1, 8, ["--data.micro_batch_size=many"], "data.micro_batch_size='many': must be a whole"),
    ],
)
def test_what_cannot_divide_is_refused_naming_the_fix(
    nodes: int, gpus: int, fit_args: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        render(PAPER, nodes, gpus, fit_args=fit_args)


def test_plan_batch() -> None:
    assert plan_batch(256, 32, 4) == (32, 2)
    assert plan_batch(256, 32, 32) == (8, 1)
    assert plan_batch(256, 4, 8) == (4, 8)
    assert plan_batch(1024, 16, 16) == (16, 4)  # pythia-410m on 2 x 8
    with pytest.raises(ConfigError, match="micro_batch_size=3 does not divide"):
        plan_batch(256, 3, 8)


def test_fit_overrides_reads_both_spellings_and_the_last_wins() -> None:
    found = fit_overrides(["--trainer.max_steps=10", "--data.micro_batch_size", "8",
                           "--trainer.default_root_dir=runs/x", "--data.micro_batch_size=4"])
    assert found == {"data.micro_batch_size": 4, "trainer.default_root_dir": "runs/x"}


def test_global_batch_arithmetic() -> None:
    check_global_batch(256, 32, devices=8, nodes=1, accumulate=1)
    check_global_batch(256, 8, devices=8, nodes=2, accumulate=2)
    with pytest.raises(ConfigError, match="multiple"):
        check_global_batch(256, 3, devices=8, nodes=1, accumulate=1)


def test_dry_run_prints_script(capsys: pytest.CaptureFixture[str]) -> None:
    code = sinklm_main(["slurm-submit", "--config", str(PAPER), "--nodes", "1",
                        "--gpus-per-node", "8", "--dry-run", "--", "--trainer.max_steps=10"])
    out = capsys.readouterr().out
    assert code == 0
    assert "#SBATCH --nodes=1" in out and "--trainer.max_steps=10" in out


def test_submit_without_sbatch_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    code = sinklm_main(["slurm-submit", "--config", str(PAPER), "--nodes", "1",
                        "--gpus-per-node", "8"])
    assert code == 2 and "sbatch is not on PATH" in capsys.readouterr().err


@pytest.mark.parametrize(("nodes", "gpus", "procid"), [(1, 8, 5), (4, 8, 27), (2, 4, 6)])
def test_slurm_environment_maps_ranks(monkeypatch: pytest.MonkeyPatch, nodes: int, gpus: int,
                                      procid: int) -> None:
    """The variables SLURM sets for our script's shape give Lightning the ranks we expect."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    env = {
        "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "sinklm-run", "SLURM_NTASKS": str(nodes * gpus),
        "SLURM_NTASKS_PER_NODE": str(gpus), "SLURM_NNODES": str(nodes),
        "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % gpus),
        "SLURM_NODEID": str(procid // gpus), "SLURM_NODELIST": "gpu[001-004]",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    environment = SLURMEnvironment()
    assert SLURMEnvironment.detect()
    assert environment.world_size() == nodes * gpus
    assert environment.global_rank() == procid
    assert environment.local_rank() == procid % gpus
    assert environment.node_rank() == procid // gpus
    assert environment.main_address == "gpu001"


def test_an_unsplittable_shape_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = sinklm_main(["slurm-submit", "--config", str(PAPER), "--nodes", "3",
                        "--gpus-per-node", "8", "--dry-run"])
    captured = capsys.readouterr()
    assert (code, captured.out) == (2, "")
    assert captured.err.startswith("sinklm slurm-submit: data.global_batch_size=256 cannot")
    assert captured.err.count("\n") == 1


def log_dir(script: str) -> Path:
    (output,) = re.findall(r"^#SBATCH --output=(\S+)$", script, flags=re.M)
    return Path(output).parent


def test_submit_creates_the_log_folder_and_dry_run_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SLURM opens --output before the job runs and does not create its folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text('#!/bin/sh\ncat > "$SBATCH_CAPTURE"\necho "Submitted batch job 42"\n')
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SBATCH_CAPTURE", str(tmp_path / "submitted.sh"))
    monkeypatch.chdir(tmp_path)  # the config's default_root_dir is relative: runs/...
    argv = ["slurm-submit", "--config", str(PAPER), "--nodes", "1", "--gpus-per-node", "8"]

    assert sinklm_main([*argv, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert log_dir(printed) == tmp_path / "runs" / "pythia-160m-sink_token" / "slurm"
    assert not (tmp_path / "runs").exists()

    assert sinklm_main(argv) == 0
    assert "Submitted batch job 42" in capsys.readouterr().out
    submitted = (tmp_path / "submitted.sh").read_text()
    assert log_dir(submitted).is_dir()

    # An override of the run folder after -- moves the log with it.
    assert sinklm_main([*argv, "--", "--trainer.default_root_dir=elsewhere"]) == 0
    assert log_dir((tmp_path / "submitted.sh").read_text()) == tmp_path / "elsewhere" / "slurm"
    assert (tmp_path / "elsewhere" / "slurm").is_dir()


def test_sinklm_fit_reads_the_derived_batch(capsys: pytest.CaptureFixture[str]) -> None:
    """The rendered srun line, as `sinklm fit` parses it: global batch 256 on 2 x 8 GPUs."""
    from sinklm.train.fit import run_fit

    script = render(PAPER, 2, 8).script
    command = shlex.split(script[script.index("srun "):].replace("\\\n", " "))
    with pytest.raises(SystemExit) as exit_info:
        run_fit([*command[command.index("fit") + 1:], "--print_config"])
    assert exit_info.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    trainer, data = config["trainer"], config["data"]
    assert (trainer["num_nodes"], str(trainer["devices"])) == (2, "8")  # devices: int | str
    assert trainer["accumulate_grad_batches"] == 1
    assert (data["micro_batch_size"], data["global_batch_size"]) == (16, 256)


@pytest.mark.parametrize(("fit_args", "message"), [
    (["--trainer.max_step=10"],
     "trainer.max_step: no such setting; did you mean trainer.max_steps?"),
    (["--model.variant", "sinktoken"], "no such variant; did you mean sink_token?"),
    (["--trainer.max_steps=ten"], "trainer.max_steps: Expected a <class 'int'>"),  # LightningCLI's
])
def test_fit_arguments_are_checked_before_anything_is_rendered(
    fit_args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """As `sinklm fit` checks them: a typo would fail the job only after it waited in the queue."""
    code = sinklm_main(["slurm-submit", "--config", str(PAPER), "--dry-run", "--", *fit_args])
    captured = capsys.readouterr()
    assert (code, captured.out) == (2, "")
    assert captured.err.startswith("sinklm slurm-submit: ") and captured.err.count("\n") == 1
    assert message in captured.err


def test_fit_arguments_without_the_separator_say_where_they_go(
    capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        sinklm_main(["slurm-submit", "--config", str(PAPER), "--dry-run",
                     "--trainer.max_steps=10"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert ("unrecognized arguments: --trainer.max_steps=10; `sinklm fit` arguments go after --"
            in captured.err)
