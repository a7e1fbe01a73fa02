"""Alias of :mod:`adp_wire.hotpath` (the codec is its own distribution now; new code imports adp_wire)."""

import sys

import adp_wire.hotpath

sys.modules[__name__] = adp_wire.hotpath
