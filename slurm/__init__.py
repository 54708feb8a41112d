"""The SLURM job template, installed as the package ``sinklm.slurm`` so that a wheel ships it
too; ``sinklm.cli.main.bundled_file("slurm/job.sbatch")`` finds it."""
