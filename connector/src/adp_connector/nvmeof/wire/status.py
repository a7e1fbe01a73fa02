"""Alias of :mod:`adp_wire.status` (the codec is its own distribution now; new code imports adp_wire)."""

import sys

import adp_wire.status

sys.modules[__name__] = adp_wire.status
