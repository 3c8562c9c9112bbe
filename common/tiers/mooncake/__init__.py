"""Mooncake tier: kvpack objects in a Mooncake distributed store, with bounded failure.

Several vLLM and SGLang instances share one prefix cache through a Mooncake
cluster: a ``mooncake_master`` (metadata only) and segments of memory that
clients contribute (a ``mooncake_client`` holder, or the engines themselves).

What this tier adds to ``MooncakeDistributedStore``, and where:

- kvpack's object format (`gets`, `puts`). Each object is stored as header +
  payload (`kvpack.identity.objects`) under ``StoreKey.as_str()``; every load decodes
  the header and checks it against the reader's `Expectation` (and the
  payload checksum when asked), and the byte count Mooncake reports must
  equal the header's. Mooncake's ``get`` (b'' for a miss and for any error
  alike) is never used.
- Named outcomes (`codes`). Every Mooncake error code maps to one
  `TierStatus`: a miss, no space (or tenant quota), a transfer failure
  (ERROR), an RPC failure (UNAVAILABLE); the detail names the code.
- Safety (`connection`). No data call is made before a successful ``setup``
  or after ``close`` (Mooncake segfaults then): every call passes the
  `Gate`, which also makes `close` wait for calls in flight, and leaks rather
  than closes a client that a stuck call still uses.
- Bounded failure (`runner`, `connection`). Calls run on `LaneRunner`
  workers and the caller waits at most `timeout_ms` (one worker makes all
  Mooncake calls of a batch back to back from a two-slot ring, another stages
  the next step or checks and copies out the previous one meanwhile). A
  stall or a connection failure opens a circuit breaker: the tier answers
  UNAVAILABLE without calling Mooncake for `backoff_s`, a background probe
  closes the breaker when the master answers again. Construction never
  blocks: ``setup`` runs in the background and the tier answers UNAVAILABLE
  until it has succeeded. While that first connect is in progress (at most
  ``connect_wait_ms`` after start-up, and not for a master that cannot be
  reached) the tier says it is `warming_up`: puts wait for it, and the
  adapters hold (vLLM) or wait with (SGLang's prefetch thread) their lookups.
- Transfers go through a staging arena the tier owns and registers once
  (`staging`): payloads are copied in (put) or out (get) with one memcpy per
  object, so a call abandoned at its deadline can never write into a
  caller's buffer afterwards, and RDMA never sees unregistered memory.
- Groups (`puts`). With ``use_groups``, each object carries its kvpack group
  as its Mooncake group id (``ReplicateConfig.group_ids``), so members are
  leased and evicted together; members of one group that a batch could only
  partly store are removed again, so a group is present or absent as a whole.

`MooncakeTier` (`tier`) is the facade the store builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...exports import LazyExports

if TYPE_CHECKING:  # imported on first use (`kvpack.exports`)
    from .codes import MOONCAKE_CODES, Code, CodeInfo, code_info, describe
    from .connection import (
        BreakerState,
        CircuitBreaker,
        TierEvents,
        TierState,
        load_mooncake,
        supports_groups,
        supports_tenants,
    )
    from .staging import plan_steps
    from .tier import MooncakeTier

__all__ = [
    "MOONCAKE_CODES",
    "BreakerState",
    "CircuitBreaker",
    "Code",
    "CodeInfo",
    "MooncakeTier",
    "TierEvents",
    "TierState",
    "code_info",
    "describe",
    "load_mooncake",
    "plan_steps",
    "supports_groups",
    "supports_tenants",
]

__getattr__ = LazyExports.read(__name__, __file__).resolve
