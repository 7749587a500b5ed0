"""The rendezvous store a launcher hosts for the ranks it starts on one machine.

A port probed free and handed to rank 0 to bind later can be taken in between: outgoing connections of any
process get their ports from the same ephemeral range. Rank 0 then dies with EADDRINUSE before the job began.
So the launcher binds the store itself, on a port the OS assigns at that bind, keeps it for the attempt's
lifetime, and the ranks join it as clients: torch's env:// contract for an agent's store
(TORCHELASTIC_USE_AGENT_STORE, the one torchrun's agent uses). Each attempt gets a fresh store, so keys a
failed attempt left behind cannot meet the next one's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class HostedStore:
    port: int
    rank_env: dict[str, str]  # what each rank adds to its environment to join the store


@contextlib.contextmanager
def hosted_store(attempt: int = 0) -> Iterator[HostedStore]:
    """Serve a TCPStore on a port the OS picks, for as long as the block runs."""
    from torch.distributed import TCPStore  # the launcher's ranks import torch anyway

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield HostedStore(store.port, {
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),  # torch 2.1 prefixes the keys with it
        })
    finally:
        del store  # the server stops with its last reference
