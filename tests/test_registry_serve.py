"""The serving engine takes its kernels from `EngineConfig.registry` / `--registry DIR`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoopt.cli import app
from model.demo import write_demo_checkpoint
from model.serve.engine import EngineConfig, LLMEngine, SamplingParams
from model.serve.http.server import ServeOptions, engine_config

from .registry_support import torch_registry


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=4)


def test_engine_config_registry_selects_the_registry_and_its_lock(demo, tmp_path):
    reg = torch_registry(tmp_path / "mine")  # rmsnorm and swiglu locked for the CPU
    engine = LLMEngine(EngineConfig(model=str(demo), device="cpu", registry=str(reg.root),
                                    max_num_seqs=1))
    sources = engine.model.ops.sources
    assert sources["rmsnorm"].startswith("torch_v1 (") and str(reg.root) in sources["rmsnorm"]
    assert sources["attention"] == "reference"
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))[0]
    assert len(out.token_ids) == 2


def test_serve_options_carry_the_registry(tmp_path):
    opts = ServeOptions(device="cpu", registry=str(tmp_path))
    assert engine_config(opts, tmp_path).registry == str(tmp_path)


def test_generate_registry_flag(demo, tmp_path):
    reg = torch_registry(tmp_path / "mine")
    args = ["generate", "--model", str(demo), "--prompt-ids", "5,6,7", "--max-tokens", "2",
            "--device", "cpu", "--json"]
    ok = CliRunner().invoke(app, [*args, "--registry", str(reg.root)])
    assert ok.exit_code == 0, ok.output
    assert len(json.loads(ok.stdout.strip().splitlines()[-1])["token_ids"]) == 2
    missing = CliRunner().invoke(app, [*args, "--registry", str(tmp_path / "typo")])
    assert missing.exit_code == 2 and "no registry at" in missing.output
