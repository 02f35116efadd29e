"""Model runner: turns the scheduler's batch into tensors, runs the model, samples."""
