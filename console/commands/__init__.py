"""The CLI's commands, one module per command or family; `console/cli.py` registers them."""
