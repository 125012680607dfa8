"""rlctl.trainer."""
