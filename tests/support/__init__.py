"""What several test packages share (one home each): spawned TP rank processes (`ranks`), torch's
process-wide settings saved and restored around every test (`torch_state`)."""
