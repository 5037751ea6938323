"""The pieces of one generate() call: token state per sequence, compute-side buffers, and a layer's compute."""
