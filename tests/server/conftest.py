"""Offline tokenizers for the server tests, trained in a second on Python stdlib sources:
`tokenizer`: byte-level BPE with a ChatML template (GPT-2/Qwen/SmolLM2 style);
`sp_tokenizer`: Metaspace BPE with byte fallback (Llama-2/Mistral style), for leading-space and <0xNN> cases."""
from __future__ import annotations

import glob
import json
import os
import sysconfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def _corpus(n: int) -> list[str]:
    return sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:n]


def build_byte_level_tokenizer(folder: str, vocab_size: int = 2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(_corpus(40), trainer)  # 40 files (~1 MB) train in ~0.4 s on 2 cores; all 168 take ~2 s
    tok.save(os.path.join(folder, "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"), eos_token="<|im_end|>",
                                   pad_token="<|pad|>", bos_token=None, unk_token=None, chat_template=CHATML,
                                   additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def build_sentencepiece_style_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    base.train(_corpus(8), trainers.BpeTrainer(vocab_size=800, min_frequency=2, show_progress=False))
    spec = json.loads(base.to_str())["model"]
    # Byte tokens are ordinary vocabulary entries (not special), as in Llama-2 style tokenizers.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in spec["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return build_byte_level_tokenizer(str(tmp_path_factory.mktemp("bpe-tokenizer")))


@pytest.fixture(scope="session")
def sp_tokenizer():
    return build_sentencepiece_style_tokenizer()
