"""The rendezvous store a launcher hosts for the ranks it starts on one machine.

A port probed free and handed to rank 0 to bind later can be taken in between: outgoing connections of any
process get their ports from the same ephemeral range. Rank 0 then dies with EADDRINUSE before the job began.
So the launcher binds the store itself, on a port the OS assigns at that bind (or MASTER_PORT's, where the user
names one: one that is taken then fails in a second, naming it), keeps it for the attempt's lifetime, and the
ranks join it as clients: torch's env:// contract for an agent's store
(TORCHELASTIC_USE_AGENT_STORE, the one torchrun's agent uses). Each attempt gets a fresh store, so keys a
failed attempt left behind cannot meet the next one's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from megatron_ds.runtime.discovery import DiscoveryError


@dataclass(frozen=True)
class HostedStore:
    port: int
    rank_env: dict[str, str]  # what each rank adds to its environment to join the store


@contextlib.contextmanager
def hosted_store(port: int = 0, attempt: int = 0) -> Iterator[HostedStore]:
    """Serve a TCPStore on ``port`` (0: one the OS picks) for as long as the block runs. A port that cannot be
    served (another process holds it) is a DiscoveryError naming it, before any rank starts."""
    from torch.distributed import TCPStore  # the launcher's ranks import torch anyway

    try:
        store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    except RuntimeError as err:  # torch's DistNetworkError (a RuntimeError): EADDRINUSE, EACCES
        if not port:
            raise
        reason = (str(err).strip().splitlines() or ["no reason given"])[0][:200]
        raise DiscoveryError(f"MASTER_PORT={port}: cannot serve the ranks' rendezvous on it ({reason}); another "
                             "process holds it? Give another with --master-port, or unset MASTER_PORT and a free "
                             "one is picked") from None
    try:
        yield HostedStore(store.port, {
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),  # torch 2.1 prefixes the keys with it
        })
    finally:
        del store  # the server stops with its last reference
