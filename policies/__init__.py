"""Routing policies, one per module, behind one small interface."""
