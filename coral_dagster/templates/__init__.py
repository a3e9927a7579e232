"""Stage 1: the offline library of throughput-optimal mixed-GPU serving templates."""
