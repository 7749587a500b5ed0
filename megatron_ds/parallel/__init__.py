"""Process groups and tensor/sequence-parallel building blocks (no model knowledge)."""
