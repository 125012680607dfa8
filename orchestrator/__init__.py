"""rlctl.orchestrator."""
