"""The `sinklm` command line: the subcommand table and `main` (`main.py`), then the modules that
define and run the commands."""
