"""`autoopt generate` (offline, through the engine) and the serving benchmark's CPU dry run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoopt.cli import app
from model.demo import write_demo_checkpoint
from model.serve.engine import EngineConfig, LLMEngine, SamplingParams

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=2)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_generate_prompt_ids_json_equals_the_engine(demo: Path) -> None:
    result = CliRunner().invoke(app, ["generate", "--model", str(demo), "--prompt-ids",
                                      "9,10,11,12", "--max-tokens", "7", "--dtype", "float32",
                                      "--kernels", "reference", "--json"])
    assert result.exit_code == 0, result.output
    out = last_json(result.stdout)
    eng = LLMEngine(EngineConfig(model=str(demo), device="cpu", dtype="float32",
                                 kernels="reference", max_num_seqs=1))
    ref = eng.generate([[9, 10, 11, 12]], SamplingParams(max_tokens=7, temperature=0))[0]
    assert out == {"token_ids": ref.token_ids, "text": ref.text}


def test_generate_text_prompt_with_the_demo_checkpoint(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOOPT_DEMO_CHECKPOINT", str(tmp_path / "demo"))
    result = CliRunner().invoke(app, ["generate", "--prompt", "Hello, world!", "--max-tokens",
                                      "5", "--temperature", "0.8", "--seed", "3", "--json"])
    assert result.exit_code == 0, result.output
    out = last_json(result.stdout)
    assert 1 <= len(out["token_ids"]) <= 5 and isinstance(out["text"], str)
    assert (tmp_path / "demo" / "config.json").exists()


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt", "hi", "--prompt-ids", "1"], "exactly one of"),
    (["--prompt-ids", "1", "--max-tokens", "0"], "max_tokens"),
])
def test_generate_rejects_bad_input(demo: Path, args, message) -> None:
    result = CliRunner().invoke(app, ["generate", "--model", str(demo), *args])
    assert result.exit_code == 2 and message in result.output


def test_serve_bench_dry_run(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("serve_bench", REPO / "benchmarks" /
                                                  "serve_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--dry-run", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serve_bench.json").read_text())
    assert saved["rows"] == result["rows"] and [r["concurrency"] for r in saved["rows"]] == [1, 2]
    for row in saved["rows"]:
        assert row["generated_tokens"] == 6 * row["concurrency"]
        assert row["ttft_ms_mean"] > 0 and row["total_tok_s"] > 0
        assert row["decode_tok_s_per_user"] > 0
    assert "| concurrency |" in (tmp_path / "serve_bench.md").read_text()
