"""`moeserve eval` and the corpus split it reads."""

from __future__ import annotations

import json

import pytest

from moeserve.cli import main
from moeserve.eval.corpus import is_held_out, iter_documents, list_files, split_key


def test_eval_command_on_the_shipped_model(tmp_path, capsys):
    out = tmp_path / "eval.json"
    argv = [
        "eval", "--device", "cpu", "--dtype", "float32", "--corpus-roots", "stdlib",
        "--max-eval-tokens", "600", "--context", "300", "--kv-cache-memory-gb", "0.05",
        "--output-file", str(out),
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    result = json.loads(out.read_text())
    assert result == json.loads(capsys.readouterr().out)
    for key in ("loss", "perplexity", "device", "date", "commit", "command", "mtp_top1_accuracy"):
        assert key in result
    assert result["num_tokens"] >= 590
    assert result["top1_accuracy"] > 2 * result["unigram_top1_accuracy"]
    assert result["mtp_top1_accuracy"] > result["unigram_top1_accuracy"]
    assert result["loss"] < result["unigram_loss"]


def test_split_key_drops_vendoring_prefixes():
    assert split_key("pip/_vendor/rich/console.py") == "rich/console.py"
    assert split_key("setuptools/_vendor/packaging/version.py") == "packaging/version.py"
    assert split_key("json/decoder.py") == "json/decoder.py"


def test_held_out_split_is_fixed():
    # Pinned so the slice stays the same across machines and releases.
    keys = [f"pkg/module_{i}.py" for i in range(2000)]
    held = [k for k in keys if is_held_out(k)]
    assert 20 <= len(held) <= 60
    assert held[:3] == ["pkg/module_9.py", "pkg/module_10.py", "pkg/module_50.py"]


def test_train_and_eval_splits_are_disjoint_and_deduplicated(tmp_path):
    keys = [f"pkg/m{i}.py" for i in range(400)]
    held = next(k for k in keys if is_held_out(k))
    train = [k for k in keys if not is_held_out(k)][:3]
    for i, key in enumerate([held, *train]):
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_text(f"x = {i}\n")
    # A training-path copy of the held-out text, and a duplicate of a training file.
    (tmp_path / "pkg/copy_of_held.py").write_text("x = 0\n")
    (tmp_path / "pkg/copy_of_train.py").write_text("x = 1\n")
    assert {f.key for f in list_files([tmp_path])} >= {held, *train}
    eval_docs = list(iter_documents("eval", 10**6, [tmp_path]))
    train_docs = list(iter_documents("train", 10**6, [tmp_path]))
    assert eval_docs == ["x = 0\n"]
    assert sorted(train_docs) == ["x = 1\n", "x = 2\n", "x = 3\n"]
