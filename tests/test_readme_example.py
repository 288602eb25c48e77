"""The README's "bring your own" example, executed as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sao.models.tiny import build_tiny_policy
from sao.models.tokenization import build_char_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "def main(" in b]
    return block


@pytest.mark.slow
def test_readme_example_trains(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    tokenizer = build_char_tokenizer(alphabet="abginy \n")
    build_tiny_policy(tokenizer, size="0.1m", seed=0).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(readme_example(), str(README), "exec"), namespace)
    namespace["main"](str(checkpoint), str(tmp_path / "run"))  # type: ignore[operator]
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # 2 critic-only warm-up steps, then 4 actor steps (each publishes a version)
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["version"] for r in rows if "version" in r] == [0, 0, 1, 2, 3, 4]
    assert (run / "final" / "config.json").is_file()
    assert "eval/success_last" in json.loads((run / "summary.json").read_text())
