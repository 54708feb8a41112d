"""A wheel install, not only the editable one, runs the commands and finds the configs and the
SLURM template it ships (issue 12): they are package data found with importlib.resources, not
files beside the source tree found through ``__file__``.

The wheel is built once, offline (the venv's setuptools, no build isolation, no index), from a
copy of the source tree so that the checkout gets no build/ or egg-info, and installed with
``pip --target`` without dependencies: torch and the rest come from this environment. The
commands then run from outside the checkout with only the installed copy on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# What the wheel is built from: pyproject, its readme, and the folders its package-dir maps.
SOURCES = ("pyproject.toml", "README.md", "cli", "models", "data", "train", "eval", "configs",
           "slurm")
PIP = (sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input")
CONFIG = "configs/experiments/pythia-160m-sink_token.yaml"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder sinklm's wheel is installed into."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    subprocess.run([*PIP, "wheel", str(source), "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "--wheel-dir", str(tmp / "dist")], check=True)
    (wheel,) = (tmp / "dist").glob("sinklm-*.whl")
    subprocess.run([*PIP, "install", "--no-deps", "--no-index", "--quiet", "--target",
                    str(tmp / "site"), str(wheel)], check=True)
    return tmp / "site"


def run_installed(site: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` run from outside the checkout with the installed copy first on the path."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(argv, cwd=site.parent, env=env, capture_output=True, text=True)


def python(site: Path, code: str) -> str:
    """What ``code`` prints, run by this environment's interpreter on the installed copy."""
    done = run_installed(site, sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_installed_copy_is_imported_not_the_checkout(site: Path) -> None:
    """The venv's editable finder must not win over the wheel, or nothing below is tested."""
    code = ("import json, sinklm.cli, sinklm.train, sinklm.configs, sinklm.slurm\n"
            "print(json.dumps([m.__file__ for m in "
            "(sinklm.cli, sinklm.train, sinklm.configs, sinklm.slurm)]))")
    for file in json.loads(python(site, code)):
        assert Path(file).is_relative_to(site), file


def test_every_config_and_the_template_ship_and_are_found(site: Path) -> None:
    shipped = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.yaml"))
    shipped.append("slurm/job.sbatch")
    code = ("import json\nfrom sinklm.cli.main import bundled_file\n"
            f"print(json.dumps([str(bundled_file(p)) for p in {shipped!r}]))")
    for name, found in zip(shipped, json.loads(python(site, code)), strict=True):
        assert Path(found) == site / "sinklm" / name
        assert Path(found).read_bytes() == (REPO / name).read_bytes(), name


def test_the_demo_reads_its_configs(site: Path) -> None:
    code = ("from sinklm.cli import demo_lab, demo_runs\n"
            "print(demo_runs.read_config(demo_lab.LAB_DATA)['output'])\n"
            "print(demo_runs.config_file('experiments/tiny-vanilla.yaml'))")
    output, path = python(site, code).splitlines()
    assert output == "packed/bigram_backcopy"
    assert Path(path).is_relative_to(site)


def test_demo_help(site: Path) -> None:
    done = run_installed(site, str(site / "bin" / "sinklm"), "demo", "--help")
    assert done.returncode == 0, done.stderr
    assert "example:" in done.stdout


def test_slurm_submit_dry_run_with_a_bundled_config(site: Path) -> None:
    config = python(site, f"from sinklm.cli.main import bundled_file\n"
                          f"print(bundled_file({CONFIG!r}))")
    assert Path(config).is_relative_to(site)
    done = run_installed(site, str(site / "bin" / "sinklm"), "slurm-submit", "--config", config,
                         "--nodes", "2", "--gpus-per-node", "8", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --nodes=2" in done.stdout and "srun" in done.stdout
    assert f"fit --config {config}" in done.stdout
