"""Coral through a day: demand and supply over 24 hours, a simulated cloud, and the re-plan loop that joins them."""
