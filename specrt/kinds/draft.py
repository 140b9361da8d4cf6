"""draft: a vanilla draft model, the target's first N layers (fine-tuned), exported as role "draft"."""

from specrt.kinds import DrafterSpec, Training

SPEC = DrafterSpec(
    name="draft", order=2, summary="the target's first N layers, fine-tuned (a vanilla draft model)",
    runtime={"draft": "specrt.runtime.drafters.draft_model:DraftModel"}, search={"draft": "chain"},
    available="graph:draft",
    config="specrt.export.drafters.draft:DraftConfig", module="specrt.export.drafters.draft:TruncatedDraft",
    bundle_role="draft",
    training=Training(objective="specrt.export.drafters.draft:DraftObjective", epochs=10.0, lr=1e-4,
                      test_epochs=6, test_options={"num_layers": 2}),
    example_config={"num_layers": 1},
    add_hint="`specrt export --draft-layers N` (the target's first N layers) or `specrt export --draft-model PATH`; "
             "fine-tuned: `specrt train draft` then `specrt export --drafter draft`",
)
