"""Subcommands of `libra`, one module each, registered by name in `libra.cli.COMMANDS`."""
