"""`python -m libra.rollout`: rollout routing tools (see `libra.rollout.cli`)."""

from libra.rollout.cli import main

main()
