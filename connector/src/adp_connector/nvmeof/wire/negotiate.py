"""Alias of :mod:`adp_wire.negotiate` (the codec is its own distribution now; new code imports adp_wire)."""

import sys

import adp_wire.negotiate

sys.modules[__name__] = adp_wire.negotiate
