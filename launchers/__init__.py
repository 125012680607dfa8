"""rlctl.launchers."""
