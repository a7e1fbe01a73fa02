"""vLLM integration: the ``ADPConnector`` KV connector and the layout layer.

Importing this package is cheap and needs no vLLM: the connector lives in :mod:`.connector` (imported by vLLM's
factory through the name registered by :func:`register`).
"""

from __future__ import annotations

CONNECTOR_NAME = "ADPConnector"
CONNECTOR_MODULE = "adp_connector.vllm.connector"


def register() -> None:
    """vLLM ``vllm.general_plugins`` entry point: register ``ADPConnector`` under its short name (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in getattr(KVConnectorFactory, "_registry", {}):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)


__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "register"]
