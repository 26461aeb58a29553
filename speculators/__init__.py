"""Speculators: per-request draft proposers behind one interface (base.Speculator)."""
