"""Links between processes and machines: typed framing (channel), MLX groups (ring), ports."""
