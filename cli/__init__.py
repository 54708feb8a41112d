"""The `sinklm` command line: one entry point (`main.py`), a module per group of commands."""
