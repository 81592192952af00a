"""Measuring this device and its links for the planner (MLX allowed here)."""
