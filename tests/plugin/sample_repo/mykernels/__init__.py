"""A small kernel library with bugs that can be planted, for testing ExactRef's plugin and audit."""
