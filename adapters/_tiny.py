"""A tiny, locally built causal LM and tokenizer for tests and demos — no hub access at all.

``tiny_tokenizer()`` is a word-level ``PreTrainedTokenizerFast`` over a fixed vocabulary (special tokens ``<pad>``,
``<eos>``, ``<unk>``, digits, lower-case letters and a few words), left-padding; ``tiny_model(tok)`` a randomly
initialised 2-layer ``Qwen2ForCausalLM`` (hidden size 32) whose generation config knows the pad/eos ids.
``tiny_model_and_tokenizer(path)`` builds both and, given a path, saves them there and returns a model whose
``config._name_or_path`` is that path — what TRL needs to rebuild a reference model when ``beta != 0``.

``tiny_dataset()`` is a small prompt dataset; ``length_reward`` / ``digit_reward`` are cheap reward functions;
``tiny_grpo_config(output_dir, **overrides)`` a CPU-safe ``GRPOConfig`` (no bf16, no gradient checkpointing, no
reporting, no saving); ``TinyRollout`` a deterministic ``rollout_func`` that returns behaviour log-probs (some
unscored), an ``env_mask`` of tool tokens and a mix of terminated and truncated completions — what vLLM or a custom
rollout would hand TRL, without either.

Only transformers / tokenizers / datasets are imported (lazily, inside the functions): ``import lossplug`` never
imports this module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

SPECIAL = ["<pad>", "<eos>", "<unk>"]
WORDS = ["the", "answer", "is", "yes", "no", "what", "plus", "minus", "equals", "count", "to", "say", "+", "-", "="]
VOCAB = SPECIAL + [str(d) for d in range(10)] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + WORDS

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "WANDB_MODE": "disabled", "TRL_EXPERIMENTAL_SILENCE": "1"}


def offline() -> None:
    """Set the environment variables that keep transformers / datasets / TRL off the network."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


def tiny_tokenizer():
    """A word-level fast tokenizer over :data:`VOCAB` (whitespace pre-tokeniser), left padding, eos = ``<eos>``."""
    offline()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins word-level tokens with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  padding_side="left")
    return tok


def tiny_model(tok, *, hidden_size: int = 32, layers: int = 2, seed: int = 0):
    """A randomly initialised tiny ``Qwen2ForCausalLM`` (float32) for ``tok``; deterministic for a given seed."""
    offline()
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        attention_dropout=0.0, use_cache=True,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model.float()


def tiny_model_and_tokenizer(path: Optional[Union[str, Path]] = None, *, hidden_size: int = 32, layers: int = 2,
                             seed: int = 0):
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


PROMPTS = ["what is 1 plus 2", "say yes", "count to 3", "what is 4 minus 1", "say no", "the answer is",
           "count to 5", "what is 2 plus 2"]


def tiny_dataset(n: int = 8):
    """A ``datasets.Dataset`` with a ``prompt`` column (plain text, no chat template)."""
    offline()
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})


def length_reward(completions, **kwargs):
    """Reward: 1 / (1 + number of words) — short answers score higher; varies within every group."""
    return [1.0 / (1.0 + len(str(c).split())) for c in completions]


def digit_reward(completions, **kwargs):
    """Reward: fraction of words that are digits."""
    out = []
    for c in completions:
        words = str(c).split()
        out.append(sum(w.isdigit() for w in words) / max(len(words), 1))
    return out


def tiny_grpo_config(output_dir: Union[str, Path], **overrides):
    """A ``GRPOConfig`` that runs on CPU in seconds: 4 completions of at most 8 tokens per prompt, micro-batches of
    4, float32, no gradient checkpointing, no reporting, no checkpoints. ``overrides`` win."""
    offline()
    from trl import GRPOConfig

    kwargs = dict(output_dir=str(output_dir), bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False,
                  report_to="none", save_strategy="no", per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, logging_steps=1, max_steps=2, learning_rate=1e-3, seed=0,
                  dataloader_num_workers=0)
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


class TinyRollout:
    """A deterministic TRL ``rollout_func``: random completions with behaviour log-probs, no generation engine.

    Row ``i`` of a call gets ``1 + (i*5 + call) % max_len`` random word tokens; every third row is left without
    ``<eos>`` at full length (truncated), the others end with ``<eos>``. Behaviour log-probs are negative random
    numbers, ``None`` (unscored, as vLLM reports NaN) at a few positions when ``unscored`` is set. With ``tools``
    the 2nd and 3rd completion tokens of every other row are marked as tool output (``env_mask`` 0).
    """

    def __init__(self, tok, max_len: int = 8, *, seed: int = 0, unscored: bool = True, tools: bool = True,
                 truncate_every: int = 3):
        self.tok, self.max_len, self.seed = tok, max_len, seed
        self.unscored, self.tools, self.truncate_every = unscored, tools, truncate_every
        self.calls = 0
        self.__qualname__ = type(self).__qualname__

    def __call__(self, prompts, trainer):
        import torch

        gen = torch.Generator().manual_seed(self.seed + self.calls)
        call, self.calls = self.calls, self.calls + 1
        tok = self.tok
        first_word = len(SPECIAL)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
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
