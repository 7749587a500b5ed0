"""Rank discovery, site profiles, launching and supervising ranks (knows nothing of models)."""
