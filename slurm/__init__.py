"""The SLURM job template, installed as the package ``sinklm.slurm`` so that a wheel ships it
too; ``sinklm.train.cli.bundled_file("slurm/job.sbatch")`` finds it."""
