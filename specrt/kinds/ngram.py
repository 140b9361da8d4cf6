"""ngram: prompt lookup, no weights (the longest suffix match in the prompt and output so far)."""

from specrt.kinds import DrafterSpec

SPEC = DrafterSpec(
    name="ngram", order=1, summary="n-gram prompt lookup: copies what followed the last match",
    runtime={"ngram": "specrt.runtime.drafters.ngram:NGram"}, search={"ngram": "chain"}, available="always",
)
