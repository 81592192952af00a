"""Who may talk to a node: the cluster secret, signatures, API keys and origins, addresses."""
