"""rlctl.recipes."""
