"""Weights move between peers (see the README section of that name)."""
