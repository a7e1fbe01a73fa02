"""Alias of :mod:`adp_wire.stream` (the codec is its own distribution now; new code imports adp_wire)."""

import sys

import adp_wire.stream

sys.modules[__name__] = adp_wire.stream
