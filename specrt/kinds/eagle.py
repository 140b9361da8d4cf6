"""eagle: one decoder layer over (token, target feature); EAGLE-1 static tree or EAGLE-2 dynamic tree."""

from specrt.kinds import DrafterSpec, Training

SPEC = DrafterSpec(
    name="eagle", order=4, summary="one layer over (token, feature); EAGLE-1 static tree or EAGLE-2 dynamic tree",
    runtime={"eagle": "specrt.runtime.drafters.eagle:Eagle1", "eagle2": "specrt.runtime.drafters.eagle:Eagle2"},
    search={"eagle": "chain", "eagle2": "dynamic"},
    config="specrt.export.drafters.eagle:EagleConfig", module="specrt.export.drafters.eagle:EagleHead",
    graphs="specrt.export.drafters.eagle:eagle_graphs",
    public_layout="specrt.export.drafters.eagle:PUBLIC", public_loader="specrt.export.drafters.eagle:load_eagle",
    training=Training(objective="specrt.export.drafters.eagle:EagleObjective", epochs=16.0, lr=6e-4,
                      test_epochs=20, head_vocab=True),
    example_config={},
)
