"""Automatic sharding: ``AUTO`` specs decided by a solver (docs/auto.md)."""
