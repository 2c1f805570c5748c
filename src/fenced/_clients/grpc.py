"""Imported before gRPC (etcd's client): gRPC's fork support off unless the user chose.

fenced refuses gRPC in a process forked after gRPC started (``_etcd_conn.check_grpc_usable``:
gRPC's core does not survive a fork), so gRPC's own fork support can only do harm: around
every ``fork()`` of the process — ``subprocess`` with ``user=`` or ``preexec_fn``,
``multiprocessing``'s fork — it pauses or shuts down the parent's channels (a lease held
over etcd can be lost), and in the child it restarts its poller before ``exec``, where it was
seen to hang: a test server started from such a process never ran. Off, a fork leaves gRPC
alone. ``GRPC_ENABLE_FORK_SUPPORT`` set by the user is kept; it must be set before gRPC is
first imported, which is why this module is imported first.
"""

from __future__ import annotations

import os

__all__: list[str] = []

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
