"""Layer 2, memory: sizes, peak metering, the batch planner, calibration, the memory model (bytes to
tokens) and the host budget."""
