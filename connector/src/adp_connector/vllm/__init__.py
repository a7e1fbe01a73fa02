"""vLLM integration: the ``ADPConnector`` KV connector and the layout layer.

Importing this package is cheap and needs no vLLM: the connector lives in :mod:`.connector` (imported by vLLM's
factory through the name registered by :func:`register`).
"""

from __future__ import annotations

CONNECTOR_NAME = "ADPConnector"
CONNECTOR_MODULE = "adp_connector.vllm.connector"


def register() -> None:
    """vLLM ``vllm.general_plugins`` entry point: register ``ADPConnector`` under its short name (idempotent).

    The class is loaded through :func:`_load_checked`, which also validates the options: vLLM first resolves the
    connector class while it builds its configuration (``VllmConfig.__post_init__`` -> ``supports_hma_config`` ->
    ``get_connector_class``), in the process that parses the command line, before any engine process starts or
    weights load; a bad option then fails there, once, instead of in every engine process after the weights.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", None)
    if registry is None:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    elif CONNECTOR_NAME not in registry:
        registry[CONNECTOR_NAME] = _load_checked


def _load_checked() -> type:
    """The ``ADPConnector`` class, after validating the options of the ``kv_transfer_config`` vLLM resolves it for.

    vLLM 0.26 and 0.32 call a registry loader from ``KVConnectorFactory.get_connector_class(kv_transfer_config)``
    without arguments; the config is read from that caller's frame. Where it is not found (another vLLM), nothing
    is checked here: the connector's constructor validates the options in any case.
    """
    import sys

    from .config import parse_config
    from .connector import ADPConnector

    caller = sys._getframe(1)
    ktc = caller.f_locals.get("kv_transfer_config") if caller.f_code.co_name == "get_connector_class" else None
    extra = getattr(ktc, "kv_connector_extra_config", None)
    if getattr(ktc, "kv_connector", None) == CONNECTOR_NAME and isinstance(extra, dict):
        parse_config(extra)
    return ADPConnector


__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "register"]
