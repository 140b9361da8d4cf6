"""The runtime: speculative generation over a bundle's target on any backend (engines/). Imports no torch.

    generate.py    Generator: the façade `specrt generate`, the server and embedders use
    target.py      TargetModel: manifest, integrity, tokenizer, exactness, decoder, KV capacity
    pool.py        DrafterPool: drafter instances, adaptive controllers, auto's choices, serving slots
    settings.py    SpecSettings, Request, SequenceTerms (frozen)
    sequence.py    one request's steps: propose → verify → accept → commit
    drafters/      the runtime drafters (registered by their kinds in specrt/kinds/)
    acceptance.py, sampling.py, tree.py, adaptive.py, payoff.py, exactness.py, ...: the step's parts
"""
