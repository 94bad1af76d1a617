"""Byte-level BPE tokenizer for the embedded model, trained offline with the ``tokenizers`` library.

Saved with transformers' ``PreTrainedTokenizerFast.save_pretrained`` so that ``transformers`` and
``mlx_lm.load`` load it like any Hugging Face tokenizer (tokenizer.json, tokenizer_config.json with
the eos token and a ChatML-style chat template as Qwen uses).
"""

from __future__ import annotations

import json
from pathlib import Path

END_OF_TEXT = "<|endoftext|>"  # document separator in training
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a chat turn: the eos token
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` entries (specials first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (eos token, chat template) into ``out_dir``.

    The config is written by hand, with the class name both transformers 4.x and 5.x know, so the
    files load with either.
    """
    out_dir = Path(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_fast_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
