"""mtp: DeepSeek-style multi-token-prediction modules, one per draft step or one reused."""

from specrt.kinds import DrafterSpec, Training

SPEC = DrafterSpec(
    name="mtp", order=6, summary="DeepSeek-style MTP modules, cascaded or one reused",
    runtime={"mtp": "specrt.runtime.drafters.mtp:MtpDrafter"}, search={"mtp": "chain"},
    config="specrt.export.drafters.mtp:MtpConfig", module="specrt.export.drafters.mtp:MtpModules",
    graphs="specrt.export.drafter_export:mtp_graphs",
    public_loader="specrt.export.drafters.public:load_mtp",
    training=Training(objective="specrt.export.training.objectives:MtpObjective", epochs=12.0, lr=6e-4,
                      test_epochs=20, warm_start="specrt.export.drafters.mtp:mtp_warm_start"),
    example_config={"num_modules": 2},
)
