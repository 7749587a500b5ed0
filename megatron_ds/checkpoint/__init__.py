"""Checkpoint save/load, exact resume and export."""
