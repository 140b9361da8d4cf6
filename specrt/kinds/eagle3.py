"""eagle3: fused low/mid/high target features, a reduced draft vocabulary, a dynamic tree."""

from specrt.kinds import DrafterSpec, Training

SPEC = DrafterSpec(
    name="eagle3", order=5, summary="fused low/mid/high target features, reduced draft vocabulary, dynamic tree",
    runtime={"eagle3": "specrt.runtime.drafters.eagle:Eagle3",
             "eagle3-suffix": "specrt.runtime.drafters.hybrid:Eagle3SuffixFirst"},
    search={"eagle3": "dynamic", "eagle3-suffix": "chain"},  # eagle3-suffix: -k is the suffix chain's length
    config="specrt.export.drafters.eagle3:Eagle3Config", module="specrt.export.drafters.eagle3:Eagle3Head",
    shares_lm_head=lambda cfg: False,
    graphs="specrt.export.drafters.eagle3:eagle3_graphs",
    public_layout="specrt.export.drafters.eagle3:PUBLIC", public_loader="specrt.export.drafters.eagle3:load_eagle3",
    training=Training(objective="specrt.export.drafters.eagle3:Eagle3Objective", epochs=12.0, lr=6e-4,
                      test_epochs=20, warm_start="specrt.export.drafters.eagle3:eagle3_warm_start",
                      options_from_data="specrt.export.drafters.eagle3:eagle3_options"),
    example_config={"taps": [0, 1], "draft_vocab_size": 40}, random_config={"taps": [0, 1], "draft_vocab_size": 3000},
)
