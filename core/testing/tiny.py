"""lossplug.testing.tiny — a tiny causal LM, tokenizer, dataset and ``GRPOTrainer``, built locally: test a plugin
inside a real TRL trainer offline, on a CPU, in seconds.

Nothing is downloaded: the tokenizer is a word-level ``PreTrainedTokenizerFast`` over a fixed vocabulary
(:data:`VOCAB`), the model a randomly initialised 2-layer ``Qwen2ForCausalLM``. What it does not test is whether a
real model learns; what it does test is that a gate runs inside TRL's loop — every micro-batch, with TRL's masks,
gradient accumulation and logging — and that its metrics reach TRL's logs. The trainer is off-policy by default
(``num_iterations=2``): the second optimizer step re-uses the first one's rollouts, so its ratios move away from 1 and
a clip or a correction acts.

A plugin author's test (needs ``lossplug[trl]``): a gate, checked by the conformance kit, then run inside TRL.

```pycon
>>> import torch, lossplug
>>> from lossplug.testing import check_plugin
>>> from lossplug.testing.tiny import tiny_grpo_trainer
>>> @lossplug.gate("soft_cut", requires=("old_logp",))
... def soft_cut(inp, p):
...     '''A·r, with the ratio bending smoothly towards 1.3 above 1.3.'''
...     ratio = inp.update_log_ratio().clamp(-20, 20).exp()  # unclamped, exp overflows and 0·inf is a NaN gradient
...     bent = torch.where(ratio > 1.3, 1.3 + 0.1 * torch.tanh((ratio - 1.3) / 0.1), ratio)
...     cut = inp.mask & (ratio > 1.3)  # the bend damps their gradient towards 0: counted as cut
...     return lossplug.GateOutput(objective=inp.advantage * bent, active=lambda: inp.mask & ~cut,
...                                metrics={"soft_cut_frac": lambda: inp.token_fraction(cut)})
>>> print(check_plugin(soft_cut))
gate 'soft_cut' (unregistered, checked in-process) passes all 12 conformance checks
>>> class SoftCutPlugin:
...     @lossplug.hookimpl
...     def lossplug_register_gates(self, register):
...         register(soft_cut)
>>> def test_soft_cut_runs_inside_trl(tmp_path):
...     plugin = SoftCutPlugin()
...     lossplug.register_plugin(plugin, "soft_cut")
...     try:
...         trainer = tiny_grpo_trainer({"advantage": "grpo", "gates": ["soft_cut"], "reduction": "token"},
...                                     tmp_path, max_steps=2)
...         trainer.train()
...     finally:
...         lossplug.unregister_plugin(plugin)
...     logs = [row for row in trainer.state.log_history if "loss" in row]
...     assert len(logs) == 2 and all("lossplug/soft_cut/soft_cut_frac" in row for row in logs)
...     assert logs[1]["lossplug/soft_cut/soft_cut_frac"] > 0  # step 2 re-uses step 1's rollouts: ratios moved

```

The pieces, for tests that need more control:

* :func:`tiny_tokenizer` and :func:`tiny_model` (or both, optionally saved to a folder, with
  :func:`tiny_model_and_tokenizer` — TRL reloads the reference model from that folder when ``beta != 0``);
* :func:`tiny_dataset`, a ``datasets.Dataset`` of short prompts; :func:`length_reward` and :func:`digit_reward`,
  cheap reward functions whose values vary within every group;
* :func:`tiny_grpo_config`, a CPU-safe ``GRPOConfig`` (float32, no gradient checkpointing, no reporting, no saving,
  off-policy from the second optimizer step);
* :class:`TinyRollout`, a deterministic ``rollout_func`` that hands TRL what vLLM or a custom rollout would —
  behaviour log-probs (some unscored), an ``env_mask`` of tool tokens, terminated and truncated completions —
  without either;
* :func:`tiny_grpo_trainer`, all of the above assembled into a ``LossplugGRPOTrainer``.

Importing this module is cheap: transformers, tokenizers, datasets and TRL are imported inside the functions, and
``import lossplug.testing`` (loaded by every pytest run through lossplug's pytest plugin) does not import it.
Without TRL (or what it brings) every helper but :class:`TinyRollout` and :func:`offline` raises
:class:`~lossplug.MissingExtra` naming the package and ``pip install 'lossplug[trl]'``, before it builds anything.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lossplug.extras import requires_extra

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast
    from trl import GRPOConfig

    from lossplug.adapters.trl import LossplugGRPOTrainer
    from lossplug.pipeline import MetricLevel, Validate

__all__ = [
    "VOCAB",
    "PROMPTS",
    "TinyRollout",
    "digit_reward",
    "length_reward",
    "offline",
    "tiny_dataset",
    "tiny_grpo_config",
    "tiny_grpo_trainer",
    "tiny_model",
    "tiny_model_and_tokenizer",
    "tiny_tokenizer",
]


SPECIAL = ["<pad>", "<eos>", "<unk>"]
WORDS = ["the", "answer", "is", "yes", "no", "what", "plus", "minus", "equals", "count", "to", "say", "+", "-", "="]
#: the tokenizer's vocabulary: special tokens, digits, lower-case letters and a few words (54 tokens)
VOCAB = SPECIAL + [str(d) for d in range(10)] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + WORDS

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TRL_EXPERIMENTAL_SILENCE": "1",
}


def offline() -> None:
    """Set the environment variables that keep transformers / datasets / TRL off the network."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


@requires_extra("trl")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level ``PreTrainedTokenizerFast`` over :data:`VOCAB`: words split on whitespace, unknown words map to
    ``<unk>``, left padding with ``<pad>``, eos ``<eos>``, no chat template (prompts are plain text)."""
    offline()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins word-level tokens with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    return tok


@requires_extra("trl")
def tiny_model(
    tok: PreTrainedTokenizerBase, *, hidden_size: int = 32, layers: int = 2, seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised ``Qwen2ForCausalLM`` (float32) for the tokenizer ``tok``: ``layers`` layers of width
    ``hidden_size``, 4 attention heads; the same ``seed`` gives the same weights, and the global torch RNG is left as
    it was. Its generation config knows ``tok``'s pad and eos ids."""
    offline()
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        attention_dropout=0.0,
        use_cache=True,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    as_float: PreTrainedModel = model.float()  # (transformers types .float() as Any)
    return as_float


@requires_extra("trl")
def tiny_model_and_tokenizer(
    path: str | Path | None = None, *, hidden_size: int = 32, layers: int = 2, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """``(model, tokenizer)``; with ``path`` both are saved there and the model is reloaded from it, so that its
    ``config._name_or_path`` points at the folder (TRL rebuilds the reference model from it when ``beta != 0``)."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, hidden_size=hidden_size, layers=layers, seed=seed)
    if path is not None:
        from transformers import AutoModelForCausalLM

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


#: the prompts of :func:`tiny_dataset`, in order (every word is in :data:`VOCAB`)
PROMPTS = [
    "what is 1 plus 2",
    "say yes",
    "count to 3",
    "what is 4 minus 1",
    "say no",
    "the answer is",
    "count to 5",
    "what is 2 plus 2",
]


@requires_extra("trl")
def tiny_dataset(n: int = 8) -> Dataset:
    """A ``datasets.Dataset`` with a ``prompt`` column (plain text, no chat template)."""
    offline()
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})


def length_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """Reward: 1 / (1 + number of words) — short answers score higher; varies within every group."""
    return [1.0 / (1.0 + len(str(c).split())) for c in completions]


def digit_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """Reward: fraction of words that are digits."""
    out: list[float] = []
    for c in completions:
        words = str(c).split()
        out.append(sum(w.isdigit() for w in words) / max(len(words), 1))
    return out


#: the generation-schedule fields of ``GRPOConfig``: a caller who sets one of them chooses the schedule, and
#: :func:`tiny_grpo_config` adds no ``num_iterations`` of its own
_SCHEDULE_FIELDS = ("num_iterations", "steps_per_generation", "generation_batch_size")


@requires_extra("trl")
def tiny_grpo_config(output_dir: str | Path, **overrides: Any) -> GRPOConfig:
    """A ``GRPOConfig`` that runs on CPU in seconds: 4 completions of at most 8 tokens per prompt, micro-batches of
    4, float32, no gradient checkpointing, no reporting, no checkpoints. ``overrides`` win.

    Off-policy by default, so that a clip or a correction is exercised: ``num_iterations=2`` (GRPO's μ) makes TRL
    generate once per two optimizer steps and compute ``old_per_token_logps`` before the first; the second step
    re-uses the batch after an update, and its ratios ``exp(logp − old_logp)`` move (0.80–1.45 for ``dapo`` at the
    default ``learning_rate`` 3e-3: PPO's ε = 0.2 / 0.28 clips some tokens). TRL 1.16 computes old log-probs
    only when ``gradient_accumulation_steps`` is not a multiple of ``steps_per_generation × num_iterations``
    (``steps_per_generation`` defaults to ``gradient_accumulation_steps``); otherwise ``old_logp`` is
    ``logp.detach()`` and every ratio is exactly 1. With ``num_iterations=2`` that holds for any accumulation, and
    the optimizer step is still one generation batch, so the number of micro-batches per step is unchanged.
    A caller that sets ``num_iterations``, ``steps_per_generation`` or ``generation_batch_size`` chooses the
    schedule (``num_iterations`` is then TRL's default, 1); ``num_iterations=1`` is the on-policy setting."""
    offline()
    from trl import GRPOConfig

    schedule: dict[str, Any] = {} if any(f in overrides for f in _SCHEDULE_FIELDS) else {"num_iterations": 2}
    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir),
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        logging_steps=1,
        max_steps=2,
        learning_rate=3e-3,
        seed=0,
        dataloader_num_workers=0,
        **schedule,
    )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


@requires_extra("trl")
def tiny_grpo_trainer(
    recipe: Any,
    output_dir: str | Path,
    *,
    reward_funcs: Sequence[Callable[..., Any]] | None = None,
    dataset: Any = None,
    model: Any = None,
    tokenizer: Any = None,
    metrics: bool | MetricLevel = "basic",
    validate: Validate = "full",
    trainer_kwargs: dict[str, Any] | None = None,
    **config_overrides: Any,
) -> LossplugGRPOTrainer:
    """A ``LossplugGRPOTrainer`` running ``recipe`` (a preset name, mapping, YAML/JSON path or
    :class:`lossplug.Recipe`) on the tiny model, tokenizer and dataset; call ``.train()`` on it.

    ``config_overrides`` go to :func:`tiny_grpo_config` (``max_steps=2`` and ``num_iterations=2`` by default: the
    second step is off-policy; ``gradient_accumulation_steps``, ``num_iterations=1`` for on-policy, ``beta`` …). ``reward_funcs`` default to ``[length_reward]``, ``dataset`` to
    :func:`tiny_dataset`, ``tokenizer`` to :func:`tiny_tokenizer` and ``model`` to :func:`tiny_model` of that
    tokenizer. ``metrics`` and ``validate`` are the adapter's options (``metrics="full"`` also logs ratio quantiles
    and effective-sample fractions); ``trainer_kwargs`` go to the trainer itself (``rollout_func=TinyRollout(tok)``,
    ``callbacks=[...]``). Nothing leaves the machine and nothing is saved unless a ``beta != 0`` needs the model on
    disk — then pass ``model, tokenizer = tiny_model_and_tokenizer(path)``.

    lossplug's metrics are in ``trainer.state.log_history`` after training, as ``lossplug/<gate>/<metric>``.
    """
    from lossplug.adapters.trl import LossplugGRPOTrainer

    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    model = model if model is not None else tiny_model(tokenizer)
    args = tiny_grpo_config(output_dir, **config_overrides)
    return LossplugGRPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs or [length_reward]),
        args=args,
        train_dataset=dataset if dataset is not None else tiny_dataset(),
        processing_class=tokenizer,
        recipe=recipe,
        metrics=metrics,
        validate=validate,
        **(trainer_kwargs or {}),
    )


class TinyRollout:
    """A deterministic TRL ``rollout_func``: random completions with behaviour log-probs, no generation engine.

    Row ``i`` of a call gets ``1 + (i*5 + call) % max_len`` random word tokens; every third row is left without
    ``<eos>`` at full length (truncated), the others end with ``<eos>``. Behaviour log-probs are negative random
    numbers, ``None`` (unscored, as vLLM reports NaN) at a few positions when ``unscored`` is set. With ``tools``
    the 2nd and 3rd completion tokens of every other row are marked as tool output (``env_mask`` 0).
    """

    def __init__(
        self,
        tok: PreTrainedTokenizerBase,
        max_len: int = 8,
        *,
        seed: int = 0,
        unscored: bool = True,
        tools: bool = True,
        truncate_every: int = 3,
    ) -> None:
        self.tok, self.max_len, self.seed = tok, max_len, seed
        self.unscored, self.tools, self.truncate_every = unscored, tools, truncate_every
        self.calls = 0
        self.__qualname__ = type(self).__qualname__

    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, list[Any]]:
        import torch

        gen = torch.Generator().manual_seed(self.seed + self.calls)
        call, self.calls = self.calls, self.calls + 1
        tok = self.tok
        first_word = len(SPECIAL)
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
        for i, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            out["prompt_ids"].append(tok(text)["input_ids"])
            truncated = self.truncate_every > 0 and i % self.truncate_every == 0
            n = self.max_len if truncated else 1 + (i * 5 + call) % (self.max_len - 1)
            ids = torch.randint(first_word, len(tok), (n,), generator=gen).tolist()
            if not truncated:
                ids[-1] = tok.eos_token_id
            logprobs = (-3.0 * torch.rand(n, generator=gen) - 0.05).tolist()
            if self.unscored and i % 4 == 1 and n > 1:
                logprobs[0] = None
            mask = [1] * n
            if self.tools and i % 2 == 1 and n > 3:
                mask[1] = mask[2] = 0
            out["completion_ids"].append(ids)
            out["logprobs"].append(logprobs)
            out["env_mask"].append(mask)
        return out
