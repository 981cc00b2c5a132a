"""`python -m moe_tune` is the `moe-tune` command."""

from moe_tune.cli import main

main()
