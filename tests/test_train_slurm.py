"""SLURM: rendered scripts for several shapes, rank mapping, global batch checks."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from sinklm.models.config import ConfigError
from sinklm.train.batching import check_global_batch
from sinklm.train.cli import main as sinklm_main
from sinklm.train.slurm import render

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "configs" / "experiments" / "pythia-160m-sink_token.yaml"


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
    script = render(path, nodes, gpus, partition="gpu", account="lab", time="02:00:00")
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


def test_unreachable_global_batch_is_refused_before_submit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="accumulate_grad_batches=2"):
        render(PAPER, nodes=1, gpus_per_node=4)  # 32 x 4 = 128 per step: needs accumulation 2


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


def test_two_nodes_at_the_paper_micro_batch_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code = sinklm_main(["slurm-submit", "--config", str(PAPER), "--nodes", "2",
                        "--gpus-per-node", "8", "--dry-run"])
    assert code == 2
    assert "global_batch_size=256 is not reached" in capsys.readouterr().err
