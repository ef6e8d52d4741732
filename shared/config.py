"""Configuration dataclasses, built from the command line in one place (client/cli.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """What the verify service accepts; every request is checked against these before model work."""

    max_tree_nodes: int = 64
    max_tree_depth: int = 32
    max_prompt_tokens: int = 4096
    max_context: int | None = None  # tokens per session; None = the model's max_position_embeddings
    max_sessions: int = 16
    session_idle_ttl_s: float = 300.0
    max_draft_support: int = 256  # entries per draft-probability row
    max_receive_bytes: int = 4 * 2**20  # per request message
    max_send_bytes: int = 64 * 2**20  # per reply message


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 dynamic draft tree (Li et al. 2024, EAGLE-2, §4): at each of `depth` levels expand
    the `top_b` best frontier nodes by joint probability, each into its `top_b` best children;
    verify the `max_nodes` best nodes overall.

    Defaults suit a 2-core CPU client and server: with a 135M target a 16-32 node tree costs about
    two single-token forwards, and each drafter level costs one small forward on the client.
    """

    depth: int = 5
    top_b: int = 4
    max_nodes: int = 24

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_b < 1 or self.max_nodes < 1:
            raise ValueError(f"tree depth, top_b and max_nodes must be >= 1: {self}")
