"""What a peer engine is, in a module that imports nothing heavy: the peer workers that run in a venv of
their own (vLLM, OpenVINO GenAI) build these without specrt's runtime (onnxruntime) installed there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Peer:
    """Another engine run on the same prompt token ids: run(ids, max_new_tokens) -> (new ids, seconds).

    `reference` names the engine whose greedy output this one must reproduce (its own engine's plain
    run, e.g. "transformers-plain"; "plain" is specrt's); None marks a reference itself (a plain peer),
    whose output is then compared with specrt's plain output only (`same_as_specrt_plain`).
    A bare callable given as a peer counts as Peer(run, reference="plain"). `specrt bench`'s peers run in
    their own worker processes (tools/peer_worker.py): `run` sends the ids there and returns the seconds
    the worker timed around generation.
    """

    run: Callable[[list[int], int], tuple[list[int], float]]
    reference: str | None = "plain"
    settings: dict = field(default_factory=dict)  # recorded in the results' config
