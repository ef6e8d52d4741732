"""The composition root: the `splitspec` command (cli/main.py) wires every room's parsers."""
