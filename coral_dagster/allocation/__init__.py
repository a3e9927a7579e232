"""Stage 2: the online allocation of template instances to regions, and the baselines."""
