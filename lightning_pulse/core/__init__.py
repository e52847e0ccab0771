"""Framework-free torch code: loss capture, sample scores, gradient caches, pruning schedules."""
