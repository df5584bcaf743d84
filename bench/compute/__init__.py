"""What this machine computes at best, with no server: the in-process ceiling and the limits, the
batch curve, the batcher's packing on a simulated clock, and the GPU extras."""
