"""CuTe DSL as a kernel language: every LANGUAGE = "cute" variant compiles for sm_90a on a machine
without a GPU (CUTE_DSL_ARCH=sm_90a in a child process), broken ones are reported, and the
load cache is keyed by the source's sha256 and the arch."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import pytest

from model.registry import cute as cute_dsl

ROOT = Path(__file__).resolve().parents[1]
needs_dsl = pytest.mark.skipif(cute_dsl.unavailable() is not None,
                               reason=f"{cute_dsl.unavailable()}: the CuTe compile check needs "
                                      "nvidia-cutlass-dsl (pip install -e '.[test]')")

_TINY = '''
LANGUAGE = "cute"
ARCHS = ("sm_90",)
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor


@cute.kernel
def _scale_kernel(x: cute.Tensor, y: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < x.shape[0]:
        y[i] = x[i] * 2.0{BUG}


@cute.jit
def scale(x: cute.Tensor, y: cute.Tensor):
    _scale_kernel(x, y).launch(grid=((x.shape[0] + 127) // 128, 1, 1), block=(128, 1, 1))


def run(x, config=None):
    raise NotImplementedError


def precompile(arch="sm_90a"):
    n = cute.sym_int()
    x = make_fake_compact_tensor(cutlass.Float32, (n,))
    y = make_fake_compact_tensor(cutlass.Float32, (n,))
    cute.compile(scale, x, y)
    return ["scale"]
'''


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / "op" / f"{name}.py"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


def test_cute_variants_are_found_by_their_declaration(tmp_path):
    _write(tmp_path, "cute_a", _TINY.replace("{BUG}", ""))
    _write(tmp_path, "triton_a", 'LANGUAGE = "triton"\n')
    _write(tmp_path, "plain", "X = 1\n")
    assert [p.name for p in cute_dsl.cute_variants(tmp_path)] == ["cute_a.py"]
    assert ROOT / "kernels" / "moe_experts" / "cute_v1.py" in cute_dsl.cute_variants(
        ROOT / "kernels")


@pytest.mark.parametrize("arch,want", [("sm_90", "sm_90a"), ("sm_90a", "sm_90a"),
                                       ("sm_100", "sm_100a"), ("sm_80", "sm_80")])
def test_dsl_arch(arch, want):
    assert cute_dsl.dsl_arch(arch) == want


def test_bad_arch_is_refused():
    with pytest.raises(ValueError, match="not a CUDA arch"):
        cute_dsl.dsl_arch("cpu")


@needs_dsl
@pytest.mark.slow
@pytest.mark.parametrize("path", cute_dsl.cute_variants(ROOT / "kernels"),
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_cute_variant_compiles_for_sm90a(path):
    assert cute_dsl.check_compiles(path, "sm_90a") == []


@needs_dsl
def test_a_compiling_variant_passes_and_a_broken_one_is_reported(tmp_path):
    good = _write(tmp_path, "good", _TINY.replace("{BUG}", ""))
    assert cute_dsl.check_compiles(good, "sm_90a") == []
    bad = _write(tmp_path, "bad", _TINY.replace("{BUG}", " + undefined_name"))
    errors = cute_dsl.check_compiles(bad, "sm_90a")
    assert errors and "undefined_name" in errors[0]


@needs_dsl
def test_a_variant_without_precompile_is_reported(tmp_path):
    src = _TINY.replace("{BUG}", "").replace("def precompile(", "def not_precompile(")
    errors = cute_dsl.check_compiles(_write(tmp_path, "noprecompile", src), "sm_90a")
    assert errors and "precompile" in errors[0]


@needs_dsl
def test_compile_is_cached_by_sha_and_refuses_other_bytes():
    src = _TINY.replace("{BUG}", "")
    sha = hashlib.sha256(src.encode()).hexdigest()
    run = cute_dsl.compile(src, sha, "sm_90")
    assert cute_dsl.compile(src, sha, "sm_90a") is run  # sm_90 and sm_90a: one DSL target
    with pytest.raises(ValueError, match="refusing"):
        cute_dsl.compile(src + "\n# changed\n", sha, "sm_90")
