"""Trainer-side client of the stoker sidecar.

``for batch in stoker.batches(): ...`` yields :class:`Batch` objects whose arrays are views into
the sidecar's shared-memory ring.
"""

from .client import (
    Batch,
    Client,
    DataTimeout,
    SidecarUnavailable,
    StokerError,
    batches,
    default_socket_path,
)

__all__ = [
    "Batch",
    "Client",
    "DataTimeout",
    "SidecarUnavailable",
    "StokerError",
    "batches",
    "default_socket_path",
]
__version__ = "0.1.0"
