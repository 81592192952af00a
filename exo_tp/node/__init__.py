"""The node daemon: discovery, cluster formation, worker management and the HTTP API."""
