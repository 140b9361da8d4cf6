"""specrt's own CPU kernels for the target: int4 weights times int8 activations, rows tiled, every row's
arithmetic independent of the rows beside it (csrc/w4a8.h); the decoder pass around them (csrc/model.cpp)."""
