"""The bundle manifest: the one description of a bundle that every downstream part reads.

A bundle is a folder complete on its own: ONNX graphs with external weights, tokenizer files and
`manifest.json`. Nothing downstream guesses from file names.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.schema.checks import FieldError
from specrt.schema.config import DecoderConfig
from specrt.schema.manifest_schema import validate_manifest

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1  # a bundle of Llama-style maths: what every specrt since the first reads
# Config fields that schema 1 did not have (sliding windows, Gemma's maths). A reader of schema 1 drops a
# config key it does not know, and would compute Llama's maths for such a bundle without a word; a bundle
# that uses any of them (a value other than its default) is written as schema 2, which that reader refuses.
SCHEMA_2_FIELDS = ("layer_windows", "activation", "embed_scale", "sandwich_norms", "query_pre_attn_scalar",
                   "attn_logit_softcapping", "final_logit_softcapping", "layer_rope", "local_rope_inv_freq",
                   "local_rope_attention_scaling")
READS = (1, 2)


def _default(name: str):
    f = next(f for f in fields(DecoderConfig) if f.name == name)
    return f.default_factory() if f.default is MISSING else f.default


def schema_for(configs) -> int:
    """The lowest schema version whose readers compute what these configs say."""
    uses_new = any(getattr(c, name) != _default(name) for c in configs for name in SCHEMA_2_FIELDS)
    return 2 if uses_new else SCHEMA_VERSION


@dataclass
class GraphEntry:
    """One exported graph: its role (target, draft, ...), file, config and I/O names."""

    role: str
    file: str
    config: DecoderConfig
    inputs: list[str]
    outputs: list[str]
    opset: int
    source: str = ""
    sha256: dict[str, str] = field(default_factory=dict)  # file name -> digest

    def to_dict(self) -> dict:
        d = asdict(self)
        d["config"] = self.config.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict, key: str = "graph") -> GraphEntry:
        return cls(**{**d, "config": DecoderConfig.from_dict(d["config"], f"{key}.config")})


@dataclass
class Manifest:
    graphs: dict[str, GraphEntry]
    tokenizer: dict  # {"file", "chat_template", "bos_token", "eos_token", "add_bos_token"}
    versions: dict
    schema_version: int = SCHEMA_VERSION  # as read; written as schema_for(the graphs' configs)
    artifacts: dict = field(default_factory=dict)  # engines built from the graphs, by backend
    drafters: dict = field(default_factory=dict)  # learned drafters by kind: {"graphs", "config", ...}
    # `specrt tune`'s choice, used when a command names no drafter: {"drafter", "num_draft_tokens", ...}
    runtime_defaults: dict = field(default_factory=dict)

    @property
    def target(self) -> GraphEntry:
        return self.graphs["target"]

    def drafter(self, kind: str, bundle: Path) -> dict:
        """The manifest entry of learned drafter `kind`, or a clear error naming the export to run."""
        if kind not in self.drafters:
            have = ", ".join(sorted(self.drafters)) or "none"
            raise SpecrtError(f"bundle {bundle} has no {kind} drafter (it has: {have}): export it with "
                              f"`specrt export --drafter {kind}` (train one first with `specrt train {kind}`)")
        return self.drafters[kind]

    def drafter_tree(self, runtime_name: str) -> list | None:
        """The static tree (list of paths) stored with a learned drafter, if any."""
        from specrt.kinds import runtime_drafters

        spec = runtime_drafters().get(runtime_name)
        return self.drafters[spec.name].get("tree") if spec and spec.name in self.drafters else None

    def onnx_path(self, bundle: Path, role: str) -> Path:
        """The graph to load for `role` on ONNX Runtime: the `specrt build` artifact if there is one."""
        built = self.artifacts.get("onnxruntime", {}).get("graphs", {}).get(role)
        if built and (Path(bundle) / built["file"]).is_file():
            return Path(bundle) / built["file"]
        return Path(bundle) / self.graphs[role].file

    def to_json(self) -> str:
        version = schema_for(g.config for g in self.graphs.values())
        d = {"schema_version": version, "versions": self.versions, "tokenizer": self.tokenizer,
             "graphs": {k: g.to_dict() for k, g in self.graphs.items()}, "artifacts": self.artifacts,
             "drafters": self.drafters, "runtime_defaults": self.runtime_defaults}
        return json.dumps(d, indent=2)

    def save(self, bundle: Path) -> None:
        """Write manifest.json atomically (temporary file, then rename)."""
        tmp = bundle / (MANIFEST + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(bundle / MANIFEST)

    @classmethod
    def load(cls, bundle: str | Path) -> Manifest:
        """Read and check `bundle`/manifest.json: a wrong type, range or path names its field."""
        bundle = Path(bundle)
        path = bundle / MANIFEST
        if bundle.exists() and not bundle.is_dir():
            raise SpecrtError(f"bundle {bundle} is a file, not a bundle folder: name the folder `specrt export` wrote "
                              "(the one holding manifest.json), e.g. artifacts/bundles/smollm2-135m-instruct")
        if not bundle.is_dir():
            raise SpecrtError(f"bundle {bundle} does not exist: run `specrt export -o {bundle}` (or `make export`) first")
        if not path.is_file():
            raise SpecrtError(f"{path} is missing: {bundle} is not a complete specrt bundle; export it again")
        try:
            d = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SpecrtError(f"{path} is not readable JSON ({type(e).__name__}: {e}): re-export the bundle") from None
        version = d.get("schema_version") if isinstance(d, dict) else None
        if version not in READS:
            raise SpecrtError(f"{path} has schema_version {version}, this specrt reads "
                              f"{' and '.join(map(str, READS))}: export the bundle again with this specrt")
        try:
            validate_manifest(d)
            graphs = {k: GraphEntry.from_dict(g, f"graphs.{k}") for k, g in d["graphs"].items()}
        except FieldError as e:
            raise SpecrtError(f"{path}: {e}: re-export the bundle") from None
        except (KeyError, TypeError) as e:
            raise SpecrtError(f"{path} is corrupt ({type(e).__name__}: {e}): re-export the bundle") from None
        return cls(graphs=graphs, tokenizer=d["tokenizer"], versions=d["versions"], schema_version=version,
                   artifacts=d.get("artifacts", {}), drafters=d.get("drafters", {}),
                   runtime_defaults=d.get("runtime_defaults", {}))
