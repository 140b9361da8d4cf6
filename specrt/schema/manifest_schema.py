"""What `manifest.json` must hold before anything reads it: a table of checks per section, and every
path it names confined to the bundle.

    validate_manifest(d)  -> FieldError naming the field: "graphs.target.config.num_layers must be a
                             positive integer, got '30'", "graphs.draft.file must be a relative path
                             inside the bundle, got '../x'"

Paths are checked as written (relative, no '..' out of the bundle); a symlink inside the bundle is the
bundle's own business (large graph files are often linked from elsewhere).
"""

from __future__ import annotations

from specrt.schema.checks import (
    BOOL,
    BUNDLE_PATH,
    DIGESTS,
    INT_LIST,
    NON_EMPTY_TEXT,
    OBJECT,
    OPTIONAL_TEXT,
    POSITIVE_INT,
    TEXT,
    TEXT_LIST,
    Check,
    FieldError,
    check_fields,
    check_object,
    is_int,
    is_number,
    list_of,
)
from specrt.schema.config import validate_config

TOP = {
    "graphs": Check("an object of graphs with a 'target' entry", lambda v: isinstance(v, dict) and "target" in v),
    "tokenizer": OBJECT, "versions": OBJECT, "artifacts": OBJECT, "drafters": OBJECT, "runtime_defaults": OBJECT,
}
TOP_OPTIONAL = ("artifacts", "drafters", "runtime_defaults")

GRAPH = {"role": NON_EMPTY_TEXT, "file": BUNDLE_PATH, "config": OBJECT, "inputs": TEXT_LIST, "outputs": TEXT_LIST,
         "opset": POSITIVE_INT, "source": TEXT, "sha256": DIGESTS}
GRAPH_OPTIONAL = ("source", "sha256")

TOKENIZER = {"file": BUNDLE_PATH, "chat_template": TEXT, "bos_token": OPTIONAL_TEXT, "eos_token": OPTIONAL_TEXT,
             "add_bos_token": BOOL}
TOKENIZER_OPTIONAL = ("chat_template", "bos_token", "eos_token", "add_bos_token")

DRAFTER = {"kind": NON_EMPTY_TEXT, "graphs": Check("a non-empty list of graph names", list_of(
               lambda x: isinstance(x, str), non_empty=True)),
           "config": OBJECT, "vocab_ids": BUNDLE_PATH, "taps": INT_LIST,
           "tree": Check("a list of paths (lists of integers >= 0)", list_of(list_of(lambda x: is_int(x) and x >= 0))),
           "acceptance_by_depth": Check("a list of numbers in 0..1", list_of(lambda x: is_number(x) and 0 <= x <= 1)),
           "acceptance_top_k": Check("a list of numbers in 0..1", list_of(lambda x: is_number(x) and 0 <= x <= 1)),
           "acceptance_measured": Check('"run time" or "training"', lambda x: x in ("run time", "training"))}
DRAFTER_OPTIONAL = ("vocab_ids", "taps", "tree", "acceptance_by_depth", "acceptance_top_k", "acceptance_measured")

# artifacts written by `specrt build` / export: (key pattern, check); "*" is any key at that level
ARTIFACT_FIELDS: tuple[tuple[tuple[str, ...], Check], ...] = (
    (("onnxruntime", "graphs", "*", "file"), BUNDLE_PATH),
    (("onnxruntime", "graphs", "*", "sha256"), DIGESTS),
    (("onnxruntime", "fused", "*", "file"), BUNDLE_PATH),
    (("onnxruntime", "fused", "*", "sha256"), DIGESTS),
    (("onnxruntime", "fused_batched", "*", "file"), BUNDLE_PATH),
    (("onnxruntime", "fused_batched", "*", "sha256"), DIGESTS),
    (("tensorrt", "graphs", "*", "file"), BUNDLE_PATH),
    (("tensorrt", "timing_cache"), BUNDLE_PATH),
    (("reference_io", "*", "inputs"), BUNDLE_PATH),
    (("reference_io", "*", "outputs"), BUNDLE_PATH),
)


def validate_manifest(d: object) -> None:
    """Raise FieldError unless `d` (parsed manifest.json) has every field the runtime reads, of the right
    type and range, and every path it names inside the bundle."""
    OBJECT("the whole file", d)
    check_fields(d, TOP, optional=TOP_OPTIONAL)
    for role, graph in d["graphs"].items():
        check_object(f"graphs.{role}", graph, GRAPH, GRAPH_OPTIONAL)
        validate_config(graph["config"], f"graphs.{role}.config")
    check_object("tokenizer", d["tokenizer"], TOKENIZER, TOKENIZER_OPTIONAL)
    for kind, entry in d.get("drafters", {}).items():
        check_object(f"drafters.{kind}", entry, DRAFTER, DRAFTER_OPTIONAL)
        if any(g not in d["graphs"] for g in entry["graphs"]):
            raise FieldError(f"drafters.{kind}.graphs", f"names of entries in graphs ({', '.join(d['graphs'])})",
                             entry["graphs"])
    for pattern, check in ARTIFACT_FIELDS:
        for key, value in _matches(d.get("artifacts", {}), pattern, "artifacts"):
            check(key, value)


def _matches(node: object, pattern: tuple[str, ...], key: str):
    """(dotted key, value) of every field under `node` that `pattern` names (absent ones are skipped)."""
    if not pattern:
        yield key, node
        return
    if not isinstance(node, dict):
        raise FieldError(key, "an object", node)
    head, rest = pattern[0], pattern[1:]
    names = list(node) if head == "*" else [head] if head in node else []
    for name in names:
        yield from _matches(node[name], rest, f"{key}.{name}")
