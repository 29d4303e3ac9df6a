"""Coordinator: runs speculative rounds against the draft and target services."""
