"""Exact and certified arithmetic behind the ops."""
