"""rlctl.inference."""
