"""kvtide.simulator: a trace-driven discrete-event fleet simulator that runs kvtide's own router and autoscaler code."""
