"""A GGUF file's tokenizer as Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json).

Built with the ``tokenizers`` library from the ``tokenizer.ggml.*`` metadata (gpt2-type byte-level
BPE), with llama.cpp's pre-tokenizer for the file's ``tokenizer.ggml.pre`` reproduced exactly:
llama.cpp splits the text with each regex in turn (every piece of one split is split again by
the next, and text no regex matches stays a piece of its own), which is ``Split(...,
"isolated")`` in ``tokenizers``. The files load with transformers' ``PreTrainedTokenizerFast``,
so mlx-lm's ``TokenizerWrapper``, its streaming detokenizer and the chat template work as with a
Hugging Face directory.
"""

from __future__ import annotations

import json

from dflash2_mlx.models.gguf_metadata import field

# From llama.cpp src/llama-vocab.cpp (``llm_tokenizer_bpe``), by ``tokenizer.ggml.pre``.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "qwen2": (_QWEN2,),
}

# llama_token_type in llama.cpp: 3 control (special), 4 user-defined (added, matched in text).
_CONTROL, _USER_DEFINED = 3, 4


class TokenizerError(ValueError):
    """A GGUF tokenizer this project cannot rebuild; the message is one line."""


def build_tokenizer(reader):
    """A ``tokenizers.Tokenizer`` equivalent to llama.cpp's for the file's vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(f"GGUF tokenizer type {kind!r} is not supported (only gpt2-style byte-level BPE)")
    pre = field(reader, "tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZER_REGEXES:
        supported = ", ".join(PRE_TOKENIZER_REGEXES)
        raise TokenizerError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {supported}")
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_REGEXES[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
        for i in range(len(tokens))
        if types[i] in (_CONTROL, _USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    if field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], int(bos))]
        )
    return tokenizer


def tokenizer_files(reader, config: dict) -> dict[str, str]:
    """{file name: text} of tokenizer.json and tokenizer_config.json for the converted directory."""
    tokenizer = build_tokenizer(reader)
    tokens = field(reader, "tokenizer.ggml.tokens")

    def token(key: str):
        value = field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if value is None else tokens[int(value)]

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,  # decoding must give back the exact text
        "model_max_length": config.get("max_position_embeddings", 4096),
    }
    template = field(reader, "tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    return {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps({k: v for k, v in tokenizer_config.items() if v is not None}, indent=2),
    }
