"""Migrate a registry written under schema 1 to schema 2, keeping every piece of evidence.

Schema 1 records carried three shapes of `verification` under one number: `{arch: report}`
(benchmarks/gpu_kernels.py), `{"device": ..., "reports": [...]}` (the optimize loop) and `{}`
(never verified). Schema 2 has one: `{arch: [Verification]}`, each naming the sha256 it verified.
Tuned configs gain the op's fixed per-rank dims (read from the benchmark rows they were timed
at; `*` where no row says); a candidate's or rejected variant's configs move from configs/ into
its record (`proposed_configs`: configs/ holds accepted configs only); lock entries gain the
hash of the configs they run with. Report file paths become registry-relative.

    python -m model.registry.migrate [DIR]        (also `autoopt registry migrate`)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .configs import ConfigEntry, ConfigKey, ConfigTable, fixed_dims, parse_bucket
from .lock import LOCK_NAME, Lock, LockEntry
from .names import RegistryError, check_sha, dump_json, sha256_bytes
from .schema import SCHEMA, Benchmark, Provenance, Record, Variant, Verification

# Devices of schema 1 reports say "cuda"; the arch comes from the record or the GPU's name.
GPU_ARCHS = {"NVIDIA H100": "sm_90", "NVIDIA H200": "sm_90", "NVIDIA H20": "sm_90",
             "NVIDIA B200": "sm_100", "NVIDIA GB200": "sm_100", "NVIDIA B300": "sm_103"}


def _arch_of(report: Mapping[str, Any], archs: list[str] | None, where: str) -> str:
    device = str(report.get("device") or "")
    if device.startswith("cpu"):
        return "cpu"
    if archs:
        return archs[0]
    gpu = (report.get("env") or {}).get("gpu")
    for name, arch in GPU_ARCHS.items():
        if gpu and (gpu == name or gpu.startswith(name + " ")):
            return arch
    raise RegistryError(f"{where}: cannot tell the arch of a report on {device} ({gpu}); add "
                        f"'archs': ['sm_XX'] to the record and migrate again")


def verifications(old: Mapping[str, Any], sha: str, source: str, where: str
                  ) -> list[Verification]:
    """The three schema 1 shapes of `verification`, as schema 2 entries."""
    ver = old.get("verification") or {}
    if "reports" in ver:
        reports = [(_arch_of(r, old.get("archs"), where), r) for r in ver["reports"]]
    else:
        reports = [(arch, r) for arch, r in ver.items() if isinstance(r, Mapping)]
    return [Verification.from_report(arch, r, sha, source) for arch, r in reports]


def _rows(old: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    rows = list(old.get("benchmarks") or [])
    for t in old.get("tuned_configs") or []:
        rows += [{**r, "gpu": r.get("gpu") or t.get("gpu")} for r in t.get("benchmarks") or []]
    return rows


def configs_v2(op: str, old: Any, rows: list[Mapping[str, Any]], where: str) -> ConfigTable:
    """{gpu: {"T=n": cfg}} -> a table keyed by the dims of the rows timed there."""
    if not isinstance(old, Mapping):
        raise RegistryError(f"{where} must map GPU name -> {{'T=<n>': config}}")
    entries = []
    for gpu, buckets in old.items():
        for b, cfg in buckets.items():
            t = parse_bucket(b)
            seen = {fixed_dims(op, r["shape"]) for r in rows if (r.get("gpu") or r.get("device"))
                    == gpu and r.get("shape", {}).get("T") == t}
            dims = seen.pop() if len(seen) == 1 else None
            entries.append(ConfigEntry(ConfigKey(gpu, dims, t), cfg))
    return ConfigTable(tuple(entries))


def record_v2(op: str, name: str, old: Mapping[str, Any], data: bytes | None,
              proposed: ConfigTable, where: str) -> Record:
    sha = check_sha(f"{where} sha256", old.get("sha256"))
    if data is not None and sha256_bytes(data) == sha:
        variant = Variant.from_source(op, name, data)
    else:  # the file is gone or changed: the record still describes the bytes it recorded
        variant = Variant(op, name, sha)
    prov = dict(old.get("provenance") or {"agent": "unknown"})
    prov.setdefault("run", (old.get("optimize") or {}).get("run"))
    return Record(
        variant, Provenance(**prov), old.get("status", "candidate"), old.get("status_reason", ""),
        _group(verifications(old, sha, f"{op}/{name}.py", where)),
        tuple(Benchmark(b) for b in old.get("benchmarks") or ()), proposed,
        tuple(old.get("tuned_configs") or ()),
        old.get("optimize"), tuple(old.get("review") or ()))


def _group(vs: list[Verification]) -> dict[str, tuple[Verification, ...]]:
    out: dict[str, tuple[Verification, ...]] = {}
    for v in vs:
        out[v.arch] = (*out.get(v.arch, ()), v)
    return out


def _migrate_variant(root: Path, op: str, name: str, done: list[str]) -> None:
    rec_path = root / op / "records" / f"{name}.json"
    cfg_path = root / op / "configs" / f"{name}.json"
    old = json.loads(rec_path.read_text())
    if old.get("schema") == SCHEMA:
        return
    src = root / op / f"{name}.py"
    data = src.read_bytes() if src.is_file() and not src.is_symlink() else None
    cfg_old = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if cfg_old.get("schema") == SCHEMA:
        table = ConfigTable.from_json(cfg_old.get("configs", {}), str(cfg_path))
    else:
        table = configs_v2(op, cfg_old, _rows(old), str(cfg_path))
    accepted = old.get("status") == "accepted"
    rec = record_v2(op, name, old, data, ConfigTable() if accepted else table, str(rec_path))
    rec_path.write_text(dump_json(rec.to_json()))
    done.append(f"{op}/records/{name}.json -> schema {SCHEMA}")
    if table and accepted:
        cfg_path.write_text(dump_json({"schema": SCHEMA, "op": op, "variant": name,
                                       "configs": table.to_json()}))
        done.append(f"{op}/configs/{name}.json keyed by dims")
    elif cfg_path.is_file():
        cfg_path.unlink()
        done.append(f"{op}/configs/{name}.json moved into the record (not accepted)")


def _migrate_lock(root: Path, done: list[str]) -> None:
    import tomllib

    from .store import Registry

    path = root / LOCK_NAME
    if not path.is_file():
        return
    raw = tomllib.loads(path.read_text())
    reg = Registry(root, read_only=False)
    sections: dict[str, dict[str, LockEntry]] = {}
    for arch, ops in raw.items():
        for op, e in ops.items():
            if "configs_sha256" in e:
                sections.setdefault(arch, {})[op] = LockEntry(**e)
                continue
            rec = reg.read_record(op, e["variant"])
            configs = (reg.read_configs(op, e["variant"]) if rec is None or
                       rec.status == "accepted" else rec.proposed_configs)
            sections.setdefault(arch, {})[op] = LockEntry(e["variant"], e["sha256"],
                                                          configs.sha256)
            done.append(f"lock [{arch}] {op}: configs pinned ({configs.sha256[:12]})")
    path.write_text(Lock(sections).to_toml())


def migrate(root: str | Path) -> list[str]:
    """Migrate every record, configs file and the lock under `root`; returns what changed."""
    root = Path(root)
    if not root.is_dir():
        raise RegistryError(f"no registry at {root}")
    done: list[str] = []
    for rec_path in sorted(root.glob("*/records/*.json")):
        _migrate_variant(root, rec_path.parent.parent.name, rec_path.stem, done)
    _migrate_lock(root, done)
    return done


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    from .paths import shipped_root

    root = Path(args[0]) if args else shipped_root()
    for line in migrate(root) or [f"{root}: already schema {SCHEMA}"]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
