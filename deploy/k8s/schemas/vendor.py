"""Turn CustomResourceDefinition YAML files into the JSON schemas tests/deploy/test_k8s.py
validates custom resources against (offline: the CRDs are not installed anywhere in CI).

    python deploy/k8s/schemas/vendor.py CRD.yaml [CRD.yaml ...]

For each served version of each CRD it writes ``<kind lower>_<group>_<version>.json`` next to
this script: the version's ``openAPIV3Schema`` made strict the way kubernetes-validate's
``-strict`` schemas are (an object schema that lists ``properties`` refuses other keys, unless
it says ``x-kubernetes-preserve-unknown-fields``), so a misspelt field fails the test instead
of being pruned silently by the API server. ``apiVersion`` and ``kind`` are pinned to the
CRD's. The sources of the files here are listed in README.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


def strict(schema: object) -> object:
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def convert(crd: dict) -> dict[str, dict]:
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    out = {}
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        schema = strict(version["schema"]["openAPIV3Schema"])
        assert isinstance(schema, dict)
        props = schema.setdefault("properties", {})
        props["apiVersion"] = {"type": "string", "enum": [f"{group}/{version['name']}"]}
        props["kind"] = {"type": "string", "enum": [kind]}
        # metadata is Kubernetes' ObjectMeta, which the CRD leaves open
        props["metadata"] = {"type": "object"}
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind"})
        schema["$schema"] = "http://json-schema.org/draft-07/schema#"
        out[f"{kind.lower()}_{group.replace('.', '_')}_{version['name']}.json"] = schema
    return out


def main(paths: list[str]) -> int:
    for path in paths:
        for crd in yaml.safe_load_all(Path(path).read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            for name, schema in convert(crd).items():
                (HERE / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
                print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
