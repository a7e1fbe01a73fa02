"""Moved to :mod:`adp_connector.pipeline.staging` (vLLM-free); kept as an import path."""

from ..pipeline.staging import StagingPool

__all__ = ["StagingPool"]
