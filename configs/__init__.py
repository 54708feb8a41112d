"""The training and data configs, installed as the package ``sinklm.configs`` so that a wheel
ships them too; ``sinklm.train.cli.bundled_file("configs/...")`` finds them."""
