"""spikeguard policies."""
