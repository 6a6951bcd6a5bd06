"""One training step as tasks: the builder (forward, backward, gradient sums, optimizer), the event engine, pipeline schedules in time, accumulation."""
