"""medusa: K residual heads on the target's last hidden state, a static top-k tree."""

from specrt.kinds import DrafterSpec, Training

SPEC = DrafterSpec(
    name="medusa", order=3, summary="K residual heads on the last hidden state, static top-k tree",
    runtime={"medusa": "specrt.runtime.drafters.medusa:MedusaDrafter"}, search={"medusa": "stored_tree"},
    config="specrt.export.drafters.medusa:MedusaConfig", module="specrt.export.drafters.medusa:MedusaHeads",
    shares_lm_head=lambda cfg: not cfg.own_heads,
    graphs="specrt.export.drafters.medusa:medusa_graphs",
    public_layout="specrt.export.drafters.medusa:PUBLIC", public_loader="specrt.export.drafters.medusa:load_medusa",
    training=Training(objective="specrt.export.drafters.medusa:MedusaObjective", epochs=6.0, lr=1e-3,
                      test_epochs=30, head_vocab=True),
    example_config={"num_heads": 2}, random_config={"num_heads": 3},
)
