"""Alias of :mod:`adp_wire.digest` (the codec is its own distribution now; new code imports adp_wire)."""

import sys

import adp_wire.digest

sys.modules[__name__] = adp_wire.digest
