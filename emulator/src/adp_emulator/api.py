"""Compatibility name: the management plane lives in :mod:`adp_emulator.mgmt`."""

from .mgmt import *  # noqa: F403
from .mgmt import __all__  # noqa: F401
