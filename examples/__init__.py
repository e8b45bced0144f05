"""spikeguard examples."""
