"""Recipes that produce the embedded model family under models/ (see training/README.md)."""
