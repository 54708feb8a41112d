"""The training and data configs, installed as the package ``sinklm.configs`` so that a wheel
ships them too; ``sinklm.cli.main.bundled_file("configs/...")`` finds them."""
