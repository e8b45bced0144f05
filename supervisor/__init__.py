"""spikeguard supervisor."""
