"""Alias of :mod:`adp_wire.sqe` (the codec is its own distribution now; new code imports adp_wire)."""

import sys

import adp_wire.sqe

sys.modules[__name__] = adp_wire.sqe
