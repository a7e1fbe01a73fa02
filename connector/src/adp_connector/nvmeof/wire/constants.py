"""Alias of :mod:`adp_wire.constants` (the codec is its own distribution now; new code imports adp_wire)."""

import sys

import adp_wire.constants

sys.modules[__name__] = adp_wire.constants
