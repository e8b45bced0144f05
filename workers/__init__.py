"""spikeguard workers."""
