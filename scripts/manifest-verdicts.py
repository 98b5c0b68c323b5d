#!/usr/bin/env python3
"""Regenerate tests/manifests/verdicts.json: the Cyberwave platform's own verdict on every
manifest of the corpus, strict and --lenient, from the SDK's validator.

Not needed at test time. Run it when the SDK changes:

    python3 -m venv /tmp/sdkvenv && /tmp/sdkvenv/bin/pip install cyberwave
    /tmp/sdkvenv/bin/python scripts/manifest-verdicts.py

Then `cargo test --test main manifest_corpus` says where the node and the platform now differ.
The generated cases (too large to keep in the repository) are built by `generated()` below and
rebuilt identically by tests/manifest_corpus.rs.
"""

import json
import sys
import tempfile
import traceback
from pathlib import Path

from cyberwave.manifest import validate_manifest

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "manifests"


def generated():
    """name -> bytes; keep in step with `generated()` in tests/manifest_corpus.rs."""
    head = b"cyberwave:\n  inference: python i.py {body}\n"
    filler = b"# " + b"x" * 60 + b"\n"
    return {
        # About 3 MB of comments: under the node's 4 MiB limit.
        "generated-huge-3mb.yml": head + filler * 48_000,
        # About 5 MB: over it (the node refuses; a documented exception).
        "generated-huge-5mb.yml": head + filler * 80_000,
        # Many keys in one mapping: duplicate detection must stay linear.
        "generated-many-keys.yml": head
        + b"".join(b"  k%d: %d\n" % (i, i) for i in range(5_000)),
    }


def verdict(path, lenient):
    try:
        r = validate_manifest(path=path, lenient=lenient)
    except BaseException as e:  # the validator crashes on some inputs (a top-level list, …)
        return {"valid": False, "crash": type(e).__name__, "fields": []}
    fields = sorted({e.field_path for e in r.errors})
    return {
        "valid": r.valid,
        # The first few fields the platform names (a generated file can have thousands).
        "fields": fields[:12],
        "errors": len(r.errors),
        "warnings": len(r.warnings),
    }


def main():
    sys.setrecursionlimit(1000)  # Python's default, as the platform runs it
    out = {}
    files = sorted(p for p in CORPUS.iterdir() if p.suffix in (".yml", ".yaml"))
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in generated().items():
            p = Path(tmp) / name
            p.write_bytes(data)
            files.append(p)
        for p in files:
            out[p.name] = {
                "strict": verdict(p, False),
                "lenient": verdict(p, True),
            }
    (CORPUS / "verdicts.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    # The verdicts depend on these (e.g. PyYAML 6.0.4 changed which `<<` mapping wins).
    from importlib.metadata import version

    (CORPUS / "verdicts.versions").write_text(
        "".join(f"{p} {version(p)}\n" for p in ("cyberwave", "pyyaml", "pydantic"))
    )
    print(f"{len(out)} manifests -> {CORPUS / 'verdicts.json'}")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
