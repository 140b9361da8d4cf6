"""Runtime: backends, drafters and the speculative step loop. Imports no torch."""
