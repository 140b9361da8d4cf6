"""block: one pass drafts the whole block from the target's fused features (P-EAGLE / DFlash style)."""

from specrt.kinds import DrafterSpec, Training

SPEC = DrafterSpec(
    name="block", order=7, summary="one pass drafts a K-token block from fused target features (mask rows)",
    runtime={"block": "specrt.runtime.drafters.block:BlockDrafter"}, search={"block": "stored_tree"},
    config="specrt.export.drafters.block:BlockConfig", module="specrt.export.drafters.block:BlockHead",
    shares_lm_head=lambda cfg: False,
    graphs="specrt.export.drafters.block:block_graphs",
    training=Training(objective="specrt.export.drafters.block:BlockObjective", epochs=12.0, lr=6e-4,
                      test_epochs=20, warm_start="specrt.export.drafters.block:block_warm_start",
                      options_from_data="specrt.export.drafters.eagle3:eagle3_options"),
    example_config={"taps": [0, 1], "draft_vocab_size": 40, "block_size": 3},
    random_config={"taps": [0, 1], "draft_vocab_size": 3000, "block_size": 4},
)
