"""Domain types shared by every layer: specs, trajectories, tool returns, typed errors."""
