"""Drafter architectures (trainable modules) shared by the client, the server (LSA) and training."""
