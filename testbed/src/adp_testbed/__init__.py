"""ADP testbed: bring targets up and down, run A/B benchmarks."""
