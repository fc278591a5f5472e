"""The job's own addresses bypass any HTTP proxy that the node's environment sets.

Compute nodes often export ``http_proxy``; then a client that honours it (urllib's health probe,
the OpenAI client's httpx) sends the request for a server in the same allocation to the proxy,
which cannot reach the node's loopback, and the job fails. Both clients honour ``NO_PROXY`` /
``no_proxy``, so each `python -m agent` process adds loopback and the node's own names to both
before any client exists; vLLM, started as a child, inherits them.
"""

from __future__ import annotations

import os
import socket

LOOPBACK = ("localhost", "127.0.0.1", "::1")


def local_names() -> list[str]:
    """Loopback and this node's name: the launcher's URL names one of them (`public_host`); no
    resolver is asked, so a node with a broken DNS starts as fast."""
    return list(dict.fromkeys(n for n in (*LOOPBACK, socket.gethostname()) if n))


def bypass_proxy_for_local() -> None:
    """Add the local names to NO_PROXY and no_proxy, keeping what the site put there."""
    for key in ("NO_PROXY", "no_proxy"):
        present = [n.strip() for n in os.environ.get(key, "").split(",") if n.strip()]
        os.environ[key] = ",".join(dict.fromkeys([*present, *local_names()]))
