"""Target service: scores prefix + K draft tokens in one forward pass."""
