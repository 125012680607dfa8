"""The run-directory contract: the shared-filesystem exchange every component uses.

Layout and paths (layout.py), durable private writes (files.py), the one step-publishing protocol
(steps.py), checkpoints (checkpoints.py), weights and rollout batches behind small interfaces with one
file per transport (weights.py + weights_fs.py, batches.py + batches_fs.py), metric records
(metrics.py), placement (placement.py). Depends on nothing of rlctl but `rlctl.recipes`' leaf modules.
"""
