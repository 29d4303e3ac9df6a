"""Draft service: proposes K tokens and the laws they were sampled from."""
