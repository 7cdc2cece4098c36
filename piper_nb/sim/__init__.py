"""Simulation: cost models, discrete-event simulator, memory model, traces."""
