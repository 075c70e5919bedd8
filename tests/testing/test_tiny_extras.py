"""lossplug.testing.tiny without TRL (or what TRL brings): every helper that needs it raises one lossplug error naming
the package and `pip install 'lossplug[trl]'`, with a short traceback; TinyRollout and offline need nothing."""

from __future__ import annotations

import sys

import pytest

from lossplug.contracts import MissingExtra
from lossplug.testing import tiny


def _without(monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises, as where it is not installed


HELPERS = {
    "tiny_tokenizer": lambda tmp: tiny.tiny_tokenizer(),
    "tiny_model": lambda tmp: tiny.tiny_model(None),
    "tiny_model_and_tokenizer": lambda tmp: tiny.tiny_model_and_tokenizer(tmp),
    "tiny_dataset": lambda tmp: tiny.tiny_dataset(),
    "tiny_grpo_config": lambda tmp: tiny.tiny_grpo_config(tmp),
    "tiny_grpo_trainer": lambda tmp: tiny.tiny_grpo_trainer("grpo", tmp),
}


@pytest.mark.parametrize("hidden", ["trl", "transformers", "datasets", "tokenizers"])
@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_a_tiny_helper_without_trl_names_the_trl_extra(monkeypatch, tmp_path, helper, hidden):
    _without(monkeypatch, hidden)
    with pytest.raises(MissingExtra) as info:
        HELPERS[helper](tmp_path / "model")
    assert str(info.value) == (
        f"lossplug.testing.tiny.{helper} needs {hidden}, which is not installed: pip install 'lossplug[trl]'"
    )
    assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)
    assert not (tmp_path / "model").exists()


def test_the_rollout_and_offline_need_no_extra(monkeypatch):
    _without(monkeypatch, "trl")
    tiny.offline()

    class WordTokenizer:
        eos_token_id = 1

        def __len__(self):
            return len(tiny.VOCAB)

        def __call__(self, text):
            return {"input_ids": [tiny.VOCAB.index(w) for w in text.split()]}

    out = tiny.TinyRollout(WordTokenizer(), max_len=4)(["say yes", "say no"], trainer=None)
    assert len(out["completion_ids"]) == 2
