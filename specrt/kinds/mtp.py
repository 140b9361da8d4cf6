"""mtp: DeepSeek-style multi-token-prediction modules, one per draft step or one reused."""

from specrt.kinds import DrafterSpec, Training

SPEC = DrafterSpec(
    name="mtp", order=6, summary="DeepSeek-style MTP modules, cascaded or one reused",
    runtime={"mtp": "specrt.runtime.drafters.mtp:MtpDrafter"}, search={"mtp": "chain"},
    config="specrt.export.drafters.mtp:MtpConfig", module="specrt.export.drafters.mtp:MtpModules",
    graphs="specrt.export.drafters.mtp:mtp_graphs",
    public_layout="specrt.export.drafters.mtp:PUBLIC", public_loader="specrt.export.drafters.mtp:load_mtp",
    training=Training(objective="specrt.export.drafters.mtp:MtpObjective", epochs=12.0, lr=6e-4,
                      test_epochs=20, warm_start="specrt.export.drafters.mtp:mtp_warm_start",
                      head_vocab=True),
    example_config={"num_modules": 2}, random_config={"num_modules": 2, "num_steps": 3},
)
