"""What every member of a cluster shares, whatever its role: its settings, discovery, the
membership, the signed control plane and its messages, the status poll of its peers, and the
views it shows."""
