"""Compile-time tuning: random inputs, timing, and the on-disk tuning database."""
