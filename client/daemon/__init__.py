"""The client daemon (`splitspec up`): the client's loop behind an OpenAI-compatible HTTP API on
this device. cli.py starts it, app.py is the HTTP surface, schema.py checks requests, engine.py
runs answers one at a time, text.py turns stream events into text deltas (docs/daemon.md)."""
