"""The leader's role: formation, placement, the served model, live rebalancing, the backend
choice and the request dispatcher (a node acts on them only while it leads)."""
