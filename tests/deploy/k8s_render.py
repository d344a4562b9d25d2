"""A small kustomize: just enough of it to build deploy/k8s/ without kubectl.

``build(directory)`` returns the objects ``kubectl kustomize directory`` prints, for the
features the manifests use and nothing more: ``resources`` (files and directories),
``components``, ``configMapGenerator`` (literals, files, ``behavior: merge``, options and
``generatorOptions``), strategic-merge ``patches`` (file or inline, targeted by kind and name,
``$patch: delete`` of a whole object, ``null`` to delete a field), ``namespace`` and
``replicas``. Anything else in a kustomization, or a patch form it does not know, is an error,
so the manifests cannot start depending on a feature this renderer would silently skip.

Where kustomize's behaviour is not the API server's, this follows kustomize (v5), because
``tests/deploy/test_k8s.py`` compares the two whenever kubectl is installed:

* lists merged by key (containers, env, volumes, ...) come out with the patch's elements first,
  in the patch's order, then the original elements the patch did not name;
* a generated ConfigMap's name suffix is computed over its data with an empty name (kustomize's
  hasher looks the name up with a path it does not find), after every merge into it;
* kustomize runs, per kustomization: resources, components, generators, then patches,
  namespace and replicas.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "namespace",
    "patches",
    "configMapGenerator",
    "generatorOptions",
    "replicas",
}
# kinds that are not namespaced (only the ones these manifests could contain)
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
}
SCALABLE = {"Deployment", "StatefulSet", "ReplicaSet", "ReplicationController"}
# strategic-merge keys of the lists the patches touch (Kubernetes' patchMergeKey)
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}


class RenderError(ValueError):
    """The kustomization asks for something this renderer does not do (or is wrong)."""


@dataclass
class Resource:
    obj: dict
    generated_name: str | None = None  # a generated ConfigMap's name before its suffix
    hash_suffix: bool = False

    @property
    def kind(self) -> str:
        return self.obj["kind"]

    @property
    def name(self) -> str:
        return self.obj["metadata"]["name"]

    def matches(self, patch: dict) -> bool:
        return (
            _group(self.obj["apiVersion"]) == _group(patch["apiVersion"])
            and self.kind == patch["kind"]
            and self.name == patch["metadata"]["name"]
            and patch["metadata"].get("namespace", self.obj["metadata"].get("namespace"))
            == self.obj["metadata"].get("namespace")
        )


@dataclass
class Accumulator:
    resources: list[Resource] = field(default_factory=list)


def _group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _kustomization(directory: Path) -> dict:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            k = yaml.safe_load(path.read_text()) or {}
            unknown = set(k) - SUPPORTED_KEYS
            if unknown:
                raise RenderError(f"{path}: unsupported kustomization fields {sorted(unknown)}")
            return k
    raise RenderError(f"{directory} has no kustomization file")


def build(directory: str | Path) -> list[dict]:
    """The objects `kubectl kustomize directory` would print (order aside)."""
    return render(directory)[0]


def render(directory: str | Path) -> tuple[list[dict], dict[str, str]]:
    """``build``'s objects, and the names given to generated ConfigMaps (base name -> name
    with its hash suffix)."""
    directory = Path(directory).resolve()
    k = _kustomization(directory)
    if k.get("kind") == "Component":
        raise RenderError(f"{directory} is a Component: it cannot be built on its own")
    acc = Accumulator()
    _apply(directory, k, acc)
    return _finish(acc)


def _apply(directory: Path, k: dict, acc: Accumulator) -> None:
    for entry in k.get("resources") or []:
        path = (directory / entry).resolve()
        if path.is_dir():
            sub = _kustomization(path)
            if sub.get("kind") == "Component":
                raise RenderError(f"{path} is a Component listed under resources")
            inner = Accumulator()
            _apply(path, sub, inner)
            _add(acc, inner.resources, path)
        else:
            _add(acc, [Resource(d) for d in load_yaml_docs(path)], path)
    for entry in k.get("components") or []:
        path = (directory / entry).resolve()
        sub = _kustomization(path)
        if sub.get("kind") != "Component":
            raise RenderError(f"{path} is listed as a component but is not a Component")
        _apply(path, sub, acc)  # a component works on what its parent has so far
    _generate(directory, k, acc)
    for patch in k.get("patches") or []:
        _patch(directory, patch, acc)
    if "namespace" in k:
        for r in acc.resources:
            if r.kind not in CLUSTER_SCOPED:
                r.obj["metadata"]["namespace"] = k["namespace"]
    for rep in k.get("replicas") or []:
        targets = [r for r in acc.resources if r.kind in SCALABLE and r.name == rep["name"]]
        if not targets:
            raise RenderError(f"replicas: no workload named {rep['name']!r}")
        for r in targets:
            r.obj.setdefault("spec", {})["replicas"] = rep["count"]


def _key(r: Resource) -> tuple[str, str, str, str | None]:
    return (
        _group(r.obj["apiVersion"]),
        r.kind,
        r.generated_name or r.name,
        r.obj["metadata"].get("namespace"),
    )


def _add(acc: Accumulator, new: list[Resource], source: Path) -> None:
    have = {_key(r) for r in acc.resources}
    for r in new:
        if _key(r) in have:
            raise RenderError(f"{source}: {r.kind} {r.name} is defined twice")
        have.add(_key(r))
        acc.resources.append(r)


# ---- generators -------------------------------------------------------------------------------


def _generate(directory: Path, k: dict, acc: Accumulator) -> None:
    global_opts = k.get("generatorOptions") or {}
    for gen in k.get("configMapGenerator") or []:
        unknown = set(gen) - {"name", "behavior", "literals", "files", "options"}
        if unknown:
            raise RenderError(f"configMapGenerator {gen['name']}: unsupported {sorted(unknown)}")
        data: dict[str, str] = {}
        for literal in gen.get("literals") or []:
            key, sep, value = literal.partition("=")
            if not sep:
                raise RenderError(f"literal {literal!r} has no '='")
            data[key] = value
        for entry in gen.get("files") or []:
            key, sep, rel = entry.partition("=")
            if not sep:
                key, rel = Path(entry).name, entry
            path = (directory / rel).resolve()
            if directory not in path.parents:
                # kustomize's default load restrictor (kubectl apply -k has no way around it)
                raise RenderError(f"{entry}: file is not in or below {directory}")
            data[key] = path.read_text()
        opts = {**global_opts, **(gen.get("options") or {})}
        behavior = gen.get("behavior", "create")
        if behavior == "create":
            meta: dict[str, Any] = {"name": gen["name"]}
            for what in ("labels", "annotations"):
                if opts.get(what):
                    meta[what] = dict(opts[what])
            obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}
            _add(
                acc,
                [Resource(obj, gen["name"], not opts.get("disableNameSuffixHash", False))],
                directory,
            )
        elif behavior in ("merge", "replace"):
            [target] = [
                r
                for r in acc.resources
                if r.kind == "ConfigMap" and (r.generated_name or r.name) == gen["name"]
            ] or [None]
            if target is None:
                raise RenderError(f"configMapGenerator {gen['name']}: nothing to {behavior}")
            if behavior == "merge":
                target.obj.setdefault("data", {}).update(data)
            else:
                target.obj["data"] = data
            for what in ("labels", "annotations"):
                if opts.get(what):
                    target.obj["metadata"].setdefault(what, {}).update(opts[what])
        else:
            raise RenderError(f"configMapGenerator {gen['name']}: behavior {behavior!r}")


def kustomize_hash(obj: dict) -> str:
    """kustomize's name suffix of a ConfigMap (api/hasher: sha256 of the JSON of kind, name,
    data (+ binaryData), the name read as "" by its path lookup; 10 hex digits re-lettered)."""
    m: dict[str, Any] = {"kind": "ConfigMap", "name": "", "data": obj.get("data") or {}}
    if obj.get("binaryData"):
        m["binaryData"] = obj["binaryData"]
    encoded = json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # Go's encoding/json escapes these (HTML safety and JavaScript line terminators)
    for char, esc in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        encoded = encoded.replace(char, esc)
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


# ---- patches ----------------------------------------------------------------------------------


def _patch(directory: Path, entry: dict, acc: Accumulator) -> None:
    if set(entry) - {"path", "patch"} or ("path" in entry) == ("patch" in entry):
        raise RenderError(f"patch {entry}: give exactly one of path / patch, and no target")
    if "path" in entry:
        docs = load_yaml_docs((directory / entry["path"]).resolve())
    else:
        docs = [d for d in yaml.safe_load_all(entry["patch"]) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc:
            raise RenderError(f"patch {entry}: only strategic-merge patches are supported")
        targets = [r for r in acc.resources if r.matches(doc)]
        if len(targets) != 1:
            raise RenderError(
                f"patch for {doc['kind']} {doc['metadata']['name']} matches {len(targets)} objects"
            )
        [target] = targets
        if doc.get("$patch") == "delete":
            acc.resources.remove(target)
            continue
        body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}
        target.obj = strategic_merge(target.obj, body)


def _strip_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value


def strategic_merge(orig: Any, patch: Any, key: str | None = None) -> Any:
    """``patch`` merged into ``orig`` the way kustomize's strategic merge does it."""
    if isinstance(patch, dict):
        directive = patch.get("$patch")
        if directive is not None:
            raise RenderError(f"$patch: {directive} inside an object is not supported")
        if not isinstance(orig, dict):
            return _strip_nulls(patch)
        out = copy.deepcopy(orig)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = _strip_nulls(copy.deepcopy(v))
        return out
    if isinstance(patch, list) and isinstance(orig, list):
        merge_key = MERGE_KEYS.get(key or "")
        if key == "ports":
            merge_key = "containerPort" if any("containerPort" in p for p in patch) else "port"
        if merge_key is None or not all(isinstance(p, dict) for p in patch + orig):
            return _strip_nulls(copy.deepcopy(patch))  # replaced whole, as kustomize does
        by_key = {o[merge_key]: o for o in orig}
        named = {p[merge_key] for p in patch}
        merged = [
            strategic_merge(by_key[p[merge_key]], p) if p[merge_key] in by_key else _strip_nulls(p)
            for p in patch
        ]
        return merged + [copy.deepcopy(o) for o in orig if o[merge_key] not in named]
    return copy.deepcopy(patch)


# ---- the end: name suffixes and the references to them ----------------------------------------


def _finish(acc: Accumulator) -> tuple[list[dict], dict[str, str]]:
    renames: dict[tuple[str | None, str], str] = {}
    for r in acc.resources:
        if r.generated_name is not None and r.hash_suffix:
            new = f"{r.generated_name}-{kustomize_hash(r.obj)}"
            renames[(r.obj["metadata"].get("namespace"), r.generated_name)] = new
            r.obj["metadata"]["name"] = new
    out = [r.obj for r in acc.resources]
    for obj in out:
        spec = pod_spec(obj)
        if spec is None:
            continue
        ns = obj["metadata"].get("namespace")

        def rename(ref: dict, field_name: str = "name", ns=ns) -> None:
            if ref is not None and (ns, ref.get(field_name)) in renames:
                ref[field_name] = renames[(ns, ref[field_name])]

        for c in spec.get("containers", []) + spec.get("initContainers", []):
            for env in c.get("env") or []:
                rename((env.get("valueFrom") or {}).get("configMapKeyRef"))
            for src in c.get("envFrom") or []:
                rename(src.get("configMapRef"))
        for vol in spec.get("volumes") or []:
            rename(vol.get("configMap"))
            for src in (vol.get("projected") or {}).get("sources") or []:
                rename(src.get("configMap"))
    return out, {base: new for (_, base), new in renames.items()}


def pod_spec(obj: dict) -> dict | None:
    """The pod spec inside a workload (None for other kinds)."""
    kind = obj.get("kind")
    if kind == "Pod":
        return obj.get("spec")
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return obj["spec"]["template"]["spec"]
    if kind == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return None
