"""What several test packages share (one home each): spawned TP rank processes (`ranks`)."""
