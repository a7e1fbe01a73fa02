"""Alias of :mod:`adp_wire.pdu` (the codec is its own distribution now; new code imports adp_wire)."""

import sys

import adp_wire.pdu

sys.modules[__name__] = adp_wire.pdu
