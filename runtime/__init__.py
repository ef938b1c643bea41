"""What runs on each rank: collectives, sharded optimizers, pipeline schedules, launching."""
