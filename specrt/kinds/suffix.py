"""suffix: suffix decoding, no weights (the most frequent continuations of the longest earlier match, in
the sequence and in a bounded store of earlier sequences)."""

from specrt.kinds import DrafterSpec

SPEC = DrafterSpec(
    name="suffix", order=1, summary="suffix decoding: a tree of what most often followed the longest match, "
    "in this sequence and in earlier ones",
    runtime={"suffix": "specrt.runtime.drafters.suffix:Suffix"}, search={"suffix": "chain_or_tree"},
    available="always",
)
