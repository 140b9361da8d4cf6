"""plain: no drafter, one token per target pass (the reference every other kind must equal)."""

from specrt.kinds import DrafterSpec

SPEC = DrafterSpec(
    name="plain", order=0, summary="no drafting: plain greedy or sampled decoding",
    runtime={"plain": "specrt.runtime.drafters.plain:Plain"}, available="always",
)
