"""`python -m libra` is the `libra` command."""

from libra.cli import main

main()
