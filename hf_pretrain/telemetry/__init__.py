"""Telemetry: device facts (measured ceilings, sensors, clocks) and the callbacks that log them.

The FLOPs formula is `modeling/accounting.py`'s and the spec peaks are `chips.py`'s.
"""
