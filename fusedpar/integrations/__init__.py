"""Adapters to other frameworks; optional extras, never imported by the core."""
