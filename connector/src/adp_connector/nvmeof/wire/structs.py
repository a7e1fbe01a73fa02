"""Alias of :mod:`adp_wire.structs` (the codec is its own distribution now; new code imports adp_wire)."""

import sys

import adp_wire.structs

sys.modules[__name__] = adp_wire.structs
