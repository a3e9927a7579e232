"""Helpers the tests share: fakes, process tools, small scenarios and brute-force oracles."""
