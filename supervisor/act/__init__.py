"""Act: the effects the recovery machine asks for, each reporting its outcome as the next
observation (kill, choose a checkpoint, launch, requests to the ranks), and the controller's own
upkeep (retention, the warm standby, reaping)."""
