"""Tools around the runtime, not on its hot path: bench, peers, tune, report, roofline, validate, lossless."""
